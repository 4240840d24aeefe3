"""Where the job's host time goes (measurement only): phase timers around the Embedder's pieces and Output.commit."""
import collections, functools, json, sys, time
import jobs.embed as E, jobs.dataset as D, jobs.run as R
T = collections.defaultdict(float); N = collections.Counter()
def timed(obj, name):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: T[name] += time.perf_counter() - t; N[name] += 1
    setattr(obj, name, w)
for n in ("_texts", "_tokenize", "_assemble", "_table"): timed(E.Embedder, n)
timed(D.Output, "commit"); timed(R, "split_errors")
from benchmarks.embed_job import main
main(sys.argv[1:])
print("PHASES", json.dumps({k: [round(v, 3), N[k]] for k, v in T.items()}))
