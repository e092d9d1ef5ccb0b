"""Weight sync: the trainer publishes a versioned, checksummed weight bundle; the engines install it.

Owns the bundle format (`bundle`), the sender's base class (`base`, importing nothing else of sync),
one module per transport, the registry of transports by name (`registry`), both ends of a sync
(`endpoints.pack`, `endpoints.unpack`) and the weight canary's check that each installed version is served
(`canary`). May import `rl_tpu.records` and `rl_tpu.config` only.

Transports (`sync.transport`):
- `object_store`: Ray's object store; readers on the same node get zero-copy numpy views.
- `shm_file`: one safetensors file per bucket in a shared-memory folder (`sync.shm_dir`).
- `collective`: a gloo group of trainer rank 0 and every engine, created on first use and bound to
  rank 0's node address; each bucket is one broadcast of its bytes, in order.
- `cuda_ipc`: CUDA IPC handles of device buckets, for an engine colocated on rank 0's GPU (`cuda_ipc.py`).
- `nccl`: an NCCL broadcast of device buckets from rank 0's GPU to every engine on GPUs of their own, through
  vLLM's weight-transfer API (`nccl.py`; not yet run on a GPU).
- `tpu_sync`: TPU Sync pushes between TPU hosts (`tpu_sync.py`; not yet run on hardware).

Each transport's class states its facts and answers the run's checks and hooks (`base.Transport`): no other
package branches on a transport's name.

To add one: subclass `base.Transport` in a module of your own and set `sync.transport=package.module:Class`, or,
built in, its module here plus its line in `registry.py` (docs/extending.md).
"""
