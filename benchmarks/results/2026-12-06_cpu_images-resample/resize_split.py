# ad-hoc (issue 51): one image's C resize on this thread against its rows split over this thread and one pool thread (wall, best of 7 medians of 300; process CPU over 1000 each)
import io, time, numpy as np
from concurrent.futures import ThreadPoolExecutor
from PIL import Image
import ivy.images as im, ivy.resample as rs
from benchmarks.images_served import photo_jpeg
jpeg, q = photo_jpeg()
img = Image.open(io.BytesIO(jpeg)); img.load()
rs.usable(im._vertical_first)
pool = ThreadPoolExecutor(1)
size, vf = (298, 224), False
def one():
    return rs.resize_crop(img, size, 3, (0, 37, 224, 224), vf)
def split():
    f = pool.submit(rs.resize_crop, img, size, 3, (112, 37, 112, 224), vf)
    a = rs.resize_crop(img, size, 3, (0, 37, 112, 224), vf)
    b = f.result()
    return np.concatenate([a, b])
assert np.array_equal(one(), split())
def bestof(f, n=300, rounds=7):
    meds = []
    for _ in range(rounds):
        ts = []
        for _ in range(n):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        meds.append(np.median(ts))
    return min(meds) * 1e6
for _ in range(2):
    print("one thread wall us", round(bestof(one)), " split over 2 wall us", round(bestof(split)))
c0 = time.process_time(); [split() for _ in range(1000)]; c1 = time.process_time(); [one() for _ in range(1000)]; c2 = time.process_time()
print("process CPU us: split", (c1 - c0) * 1e3, "one", (c2 - c1) * 1e3)
