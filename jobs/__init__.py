"""Bulk jobs on top of the services (DESIGN.md: "jobs (bulk) on top of them all"): `trellis embed` runs a
dataset through the same ROSE steps Tulip serves, in-process, against running Tulips or through an Ivy.

- `jobs.config`: `EmbedSettings` (what decides the output; stored with it) and `EmbedJobConfig` (the flags).
- `jobs.embed`: `Embedder`, the unit of work: an Arrow table of rows in, an Arrow table of results out
  (constructed once per worker: a thread here, a Ray actor there).
- `jobs.backends`: where the token ids go: the engine loop in this process, Tulips over gRPC, an Ivy over HTTP.
- `jobs.dataset`: the input's files cut into numbered parts, the output directory (parts, markers, errors).
- `jobs.run`: `trellis embed` (`python -m jobs`): workers, resume, progress, the summary.

Nothing imports this package; it imports trellis, ivy (tokenizer and templates), tulip (the engine loop) and rose.
"""
