"""Checkpoints in megatron-core's dist_checkpointing format (torch_dist), written atomically and verified on load.

Layout of ``--save DIR`` (the format: megatron_glm5/checkpoint/format.py)::

    DIR/iter_0000100/              a complete checkpoint (model, optimizer, scheduler, RNG, data position, args)
    DIR/iter_0000100/manifest.json every file's size and checksum (checkpoint/manifest.py), written last
    DIR/latest_checkpointed_iteration.txt

A save writes into ``iter_XXXXXXX.partial``; when every rank has written its files the manifest is written,
the directory renamed and then the ``latest`` pointer replaced (write + fsync + rename). A crash or a full disk
mid-save leaves the previous checkpoints and pointer untouched; a stale ``.partial`` is removed by the next
save. ``--async-save`` plans and snapshots at the save call and writes in a background thread; the manifest,
rename and pointer follow once every rank's writer is done. Loading a --save root takes the newest checkpoint
whose files match its manifest, skipping (with a warning naming the file) any newer incomplete or damaged one;
``--keep-last N`` never deletes the newest checkpoint that verifies. Sharded tensors carry global shapes and
offsets, so a checkpoint loads into any parallel layout that divides the model (``fully_reshardable``), with
the plain or the distributed optimizer whichever wrote it (training/optimizer_state.py). A resume refuses another
model (every field that changes what it computes; its record holds the model's fingerprint and description) and
keeps the checkpoint's global batch unless --global-batch-size is given.
docs/fault_tolerance.md has the guarantees and the fault-injection tests.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
import resource
import shutil
import threading

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_glm5.checkpoint import manifest as checkpoint_manifest
from megatron_glm5.checkpoint.format import (
    LATEST,
    MEGATRON_METADATA_FILE,
    RECORD_KEY,
    CheckpointFormatError,
    ModelRecord,
    complete_dirs,
    describe_difference,
    differing_fields,
    iteration_dir,
    iteration_of,
    layout_record,
    model_description,
    model_fingerprint,
    partial_dir,
    partial_dirs,
    pointed_dir,
    read_latest,
    write_latest,
)
from megatron_glm5.config import ARCH_FIELDS, ConfigError, GLM5Config  # ARCH_FIELDS: the fields shaping weights
from megatron_glm5.errors import UserError
from megatron_glm5.training import fault_hooks
from megatron_glm5.training import muon_flags, optimizer_state
from megatron_glm5.training.device import current_device
from megatron_glm5.training.optim import ensure_optimizer_state, rescale_scheduler

log = logging.getLogger("megatron_glm5.checkpoint")


class CheckpointMismatch(CheckpointFormatError):
    """The checkpoint does not belong to this model (or is not a megatron-glm5 checkpoint)."""


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _chunk_state(m) -> dict:
    """A chunk's sharded state; a LoRA chunk's ``checkpoint_scope`` narrows it (adapters, or the base: lora/)."""
    scope = getattr(m, "checkpoint_scope", None)
    return scope.view(m.sharded_state_dict()) if scope is not None else m.sharded_state_dict()


def _model_sharded_state(model_chunks) -> dict:
    if len(model_chunks) == 1:
        return {"model": _chunk_state(model_chunks[0])}
    return {f"model{i}": _chunk_state(m) for i, m in enumerate(model_chunks)}


def _rng_sharded_object():
    rng = {
        "random": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    pps, tps = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()
    dp, dps = parallel_state.get_data_parallel_rank(with_context_parallel=True), parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return ShardedObject("rng_state", rng, (pps, tps, dps), (pp, tp, dp), replica_id=0)


def _restore_rng(rng: dict):
    random.setstate(rng["random"])
    np.random.set_state(rng["np"])
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])


def trainable_of(args) -> str:
    """Which parameters the optimizer holds (its state in a checkpoint covers exactly these)."""
    if getattr(args, "lora", None) is not None:
        return args.lora.trainable_name()  # the adapters (and the indexers with --train-indexer)
    if args.dsa_stage == "dense-warmup":
        return "indexer-only"  # the warm-up trains the lightning indexers alone
    return "all-but-indexer" if args.freeze_indexer else "all"


def layout_of(args) -> dict:
    return layout_record(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                         args.expert_model_parallel_size, args.expert_tensor_parallel_size,
                         args.context_parallel_size, args.data_parallel_size)


def _in_process_results_queue():
    """dist_checkpointing's writer returns its results through a multiprocessing Manager queue that the first
    save creates: a spawned server process per rank (seconds to start) that only a writer in another process
    needs. Our writers are threads of this process (also with --async-save), so an in-process queue serves."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


class CheckpointWriteError(UserError, OSError):
    """A save failed (disk full, file-size limit, permissions): nothing was promoted, older checkpoints stand."""


def _os_error(exc: BaseException) -> OSError | None:
    """The OS error behind ``exc`` (itself, a cause or context, or a rank's failure in torch.distributed.checkpoint's
    CheckpointException), if any."""
    seen, stack = set(), [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def _dir_bytes(path: str) -> int:
    """Bytes in the files under path (0 if it is gone)."""
    total = 0
    for parent, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(parent, f))
            except OSError:
                pass
    return total


#: free space below which a failed write is reported as a full disk (not "disk full or a limit?")
FULL_DISK_BYTES = 1 << 30


def _write_error(exc: BaseException, partial: str, root: str, written: int | None = None) -> CheckpointWriteError:
    """One-line error naming the directory, the failure, and the disk's state (torch's writer reports a full
    disk or a file-size limit as 'unexpected pos ...', and megatron-core's writer wraps a worker's OS error as
    'Worker failure ...', both without the OS error: the free space left, and how much of the checkpoint this
    rank had written (``written`` bytes, measured before the partial directory is removed), tell what happened)."""
    cause = _os_error(exc)
    if cause is not None:
        what = f"[Errno {cause.errno}] {os.strerror(cause.errno)}"
    else:
        failures = getattr(exc, "failures", None)
        inner = next(iter(failures.values()), None) if isinstance(failures, dict) else None
        inner = inner[0] if isinstance(inner, tuple) else inner
        what = " ".join(str(inner if inner is not None else exc).split()) or type(exc).__name__
    disk, full = [], False
    try:
        free = shutil.disk_usage(root).free
        disk.append(f"free space there: {free / 2**30:.1f} GiB")
        full = free < FULL_DISK_BYTES
    except OSError:
        pass
    if written is not None:
        disk.append(f"{written / 2**30:.1f} GiB of it written by this rank before the failure")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        disk.append(f"this process's file-size limit (ulimit -f): {limit} bytes")
    good = [it for it, _ in complete_dirs(root)]
    kept = (f"the previous checkpoint {iteration_dir(root, good[0])} is untouched" if good
            else "no earlier checkpoint exists")
    diagnosis = "the disk is full" if full else "disk full or a file-size/quota limit?"
    return CheckpointWriteError(f"--save {root}: writing checkpoint {partial} failed ({what}); {diagnosis} "
                                f"({', '.join(disk)}); nothing was promoted, {kept}")


def _sharded_state(iteration, model_chunks, optimizer, scheduler, args, data_state) -> dict:
    state = _model_sharded_state(model_chunks)
    model_sd = state["model"] if "model" in state else {k: v for k, v in state.items()}
    state["optimizer"] = optimizer.sharded_state_dict(
        model_sd, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    state["scheduler"] = scheduler.state_dict()
    state["iteration"] = iteration
    state["data_state"] = data_state
    state["rng_state"] = _rng_sharded_object()
    state[muon_flags.OPTIMIZER_FORM_KEY] = muon_flags.optimizer_form(args)
    state[RECORD_KEY] = ModelRecord(model_config=args.model_config.to_hf(), layout=layout_of(args), mode=args.mode,
                                    trainable=trainable_of(args),
                                    model_fingerprint=model_fingerprint(args.model_config),
                                    model_description=model_description(args.model_config),
                                    global_batch_size=args.global_batch_size).to_common()
    scope = getattr(model_chunks[0], "checkpoint_scope", None)
    if scope is not None:  # a LoRA checkpoint names its base and LoRA config (lora/checkpoint.py)
        scope.annotate(state, RECORD_KEY)
    return state


def _start_partial(root: str, iteration: int) -> str:
    partial = partial_dir(root, iteration)
    if _rank0():
        os.makedirs(root, exist_ok=True)
        if os.path.exists(partial):
            shutil.rmtree(partial)
        os.makedirs(partial)
    _barrier()
    return partial


def _manifest_args(args) -> dict:
    out = {k: v for k, v in vars(args).items() if k != "model_config"}
    if getattr(args, "model_config", None) is not None:
        out["model_config"] = args.model_config.to_hf()
    return out


def _promote(root: str, iteration: int, args) -> str:
    """Every rank has written its files into the .partial directory: manifest, rename, latest pointer."""
    partial = partial_dir(root, iteration)
    final = iteration_dir(root, iteration)
    faults = fault_hooks.current()
    faults.save_point("files-written", iteration)
    checkpoint_manifest.write_manifest(partial, iteration, getattr(args, "ckpt_checksum", "sha256"),
                                       layout_of(args), _manifest_args(args))
    faults.save_point("manifest-written", iteration)
    if _rank0():
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        checkpoint_manifest.fsync_dir(root)
    _barrier()
    faults.save_point("renamed", iteration)
    if _rank0():
        write_latest(root, iteration)
    _barrier()
    faults.save_point("pointer-updated", iteration)
    return final


def _discard_partial(partial: str):
    if _rank0():
        shutil.rmtree(partial, ignore_errors=True)


def _from_rank0(obj):
    """rank 0's value of ``obj`` on every rank (directory listings: every rank must verify the same list)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]
    return obj


def apply_retention(root: str, keep_last: int | None):
    """Collective. Remove stale ``.partial`` directories (interrupted saves; the save in progress is complete by
    now) and, with --keep-last N, all but the newest N checkpoints, never one at or newer than the newest
    checkpoint that verifies (so the only good checkpoint is never deleted, even when a newer one is damaged)."""
    doomed = partial_dirs(root)
    dirs = _from_rank0(complete_dirs(root))
    if keep_last and len(dirs) > keep_last:
        newest_good = None
        for it, path in dirs:
            if not checkpoint_manifest.verify(path):
                newest_good = it
                break
        if newest_good is None:
            log.warning("--keep-last %d: no checkpoint under %s verifies; deleting none", keep_last, root)
        else:
            if newest_good < dirs[0][0]:
                log.warning("--keep-last %d: keeping %s, the newest checkpoint that verifies", keep_last,
                            iteration_dir(root, newest_good))
            doomed += [path for it, path in dirs[keep_last:] if it < newest_good]
    if _rank0():
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s", path)
    _barrier()


def _is_write_failure(exc: BaseException) -> bool:
    """An OS error, or torch.distributed.checkpoint's report of a failed write (which hides the OS error)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(exc, CheckpointException) or _os_error(exc) is not None


class _PendingSave:
    """One save between planning and promotion: the writer's request and the arguments of its write function."""

    def __init__(self, root, iteration, model_chunks, optimizer, scheduler, args, data_state, snapshot: bool):
        self.root, self.iteration, self.args = root, iteration, args
        self.partial = partial_dir(root, iteration)
        self.errors: list[BaseException] = []
        self.thread = None
        with self.failures_as_user_errors():
            _start_partial(root, iteration)
            state = _sharded_state(iteration, model_chunks, optimizer, scheduler, args, data_state)
            _in_process_results_queue()
            # planning (collectives) and serialising the non-tensor state happen here, in the caller's thread
            self.request = dist_checkpointing.save(state, self.partial, async_sharded_save=True,
                                                   async_strategy="mcore")
            self.fn_args = list(self.request.async_fn_args)
            if self.request.async_fn is not None:
                self.fn_args[1] = _host_copy(self.fn_args[1], copy=snapshot)

    @contextlib.contextmanager
    def failures_as_user_errors(self):
        try:
            yield
        except BaseException as e:  # torch's CheckpointException is a BaseException
            if not _is_write_failure(e):
                raise
            written = _dir_bytes(self.partial)
            _discard_partial(self.partial)
            raise _write_error(e, self.partial, self.root, written) from e

    def write(self):
        """Write this rank's files (no collectives: safe in a background thread)."""
        try:
            fault_hooks.current().save_point("writing", self.iteration)
            if self.request.async_fn is not None:
                self.request.async_fn(*self.fn_args, **self.request.async_fn_kwargs)
        except BaseException as e:
            self.errors.append(e)

    def complete(self) -> str:
        """Collective, after every rank's write: dist_checkpointing metadata, manifest, rename, pointer,
        retention.  First every rank learns which ranks' writes failed: then all of them stop with an error (the
        failed ones with their own), none is left waiting in a collective for a rank that stopped."""
        failed = _failed_ranks(bool(self.errors))
        with self.failures_as_user_errors():
            if self.errors:
                raise self.errors[0]
        if failed:
            _discard_partial(self.partial)
            raise CheckpointWriteError(
                f"--save {self.root}: writing checkpoint {self.partial} failed on rank(s) "
                f"{', '.join(map(str, failed))} (their error says why); nothing was promoted")
        with self.failures_as_user_errors():
            for fn in self.request.finalize_fns:
                fn()
            _barrier()
            final = _promote(self.root, self.iteration, self.args)
        log.info("saved checkpoint %s", final)
        apply_retention(self.root, getattr(self.args, "keep_last", None))
        return final


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler, args, data_state: dict) -> str:
    """Synchronous save: write into iter_XXXXXXX.partial, then manifest, rename, pointer, retention. A failed
    write (disk full, ...) raises one CheckpointWriteError and removes the .partial directory."""
    pending = _PendingSave(root, iteration, model_chunks, optimizer, scheduler, args, data_state, snapshot=False)
    pending.write()
    _barrier()
    return pending.complete()


class CheckpointSaver:
    """Saves for the training loop: synchronous, or with --async-save in a writer thread while training goes on.

    Asynchronous: the state is planned (collectives) and copied to host memory at the save call, a thread writes
    the files into ``.partial``; ``poll()`` (every step, on every rank) completes the save once all ranks'
    writers are done (metadata, manifest, rename, pointer, retention, in the main thread); ``wait()`` blocks
    until the pending save is complete (before the next save and before exit)."""

    def __init__(self, args):
        self.args = args
        self.pending: _PendingSave | None = None

    def save(self, iteration: int, model_chunks, optimizer, scheduler, data_state: dict) -> None:
        self.wait()
        if not getattr(self.args, "async_save", False):
            save_checkpoint(self.args.save, iteration, model_chunks, optimizer, scheduler, self.args, data_state)
            return
        pending = _PendingSave(self.args.save, iteration, model_chunks, optimizer, scheduler, self.args,
                               data_state, snapshot=True)
        pending.thread = threading.Thread(target=pending.write, name=f"checkpoint-writer-{iteration}", daemon=True)
        pending.thread.start()
        self.pending = pending
        log.info("writing checkpoint %s in the background (--async-save)", iteration_dir(self.args.save, iteration))

    def _all_done(self, blocking: bool) -> bool:
        thread = self.pending.thread
        if blocking:
            thread.join()
        busy = torch.tensor([1.0 if thread.is_alive() else 0.0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            busy = busy.to(current_device())
            dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        return busy.item() == 0

    def poll(self) -> None:
        """Complete the pending asynchronous save if every rank's writer has finished (collective)."""
        if self.pending is not None and self._all_done(blocking=False):
            pending, self.pending = self.pending, None
            pending.complete()

    def wait(self) -> None:
        """Block until the pending asynchronous save is complete (collective)."""
        if self.pending is not None:
            self._all_done(blocking=True)
            pending, self.pending = self.pending, None
            pending.complete()


def _failed_ranks(failed: bool) -> list[int]:
    """The ranks for which ``failed`` is true (collective: every rank gets the same list)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [0] if failed else []
    flags = torch.zeros(dist.get_world_size(), device=current_device())
    flags[dist.get_rank()] = 1.0 if failed else 0.0
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def _host_copy(write_buckets, copy: bool):
    """The writer's buckets with every tensor in host memory; ``copy``: copies even of host tensors (a snapshot
    that training cannot change while a background thread writes it)."""
    staged = []
    for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
        tensors = [(item, t.detach().to("cpu", copy=copy)) for item, t in tensor_data]
        staged.append((file_name, storage_key, (bytes_data, tensors)))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return staged


def _explicit(args) -> set:
    """The dests given on the command line or in --config (arguments.parse_args); everything when unknown."""
    flags = getattr(args, "explicit_flags", None)
    return set(vars(args)) if flags is None else set(flags)


def _model_source(args) -> str:
    """Where this run's model comes from, in the flags' words."""
    if getattr(args, "hf_config", None):
        return f"--hf-config {args.hf_config}"
    if "preset" in _explicit(args) or not getattr(args, "load", None):
        return f"--preset {args.preset}"
    return f"read from --load {args.load}"


def _saved_description(record: ModelRecord) -> dict | None:
    """The checkpoint's model description: recorded, or derived from its config.json (older checkpoints)."""
    if record.model_description is not None:
        return record.model_description
    try:
        return model_description(GLM5Config.from_hf(record.model_config))
    except (ConfigError, TypeError, ValueError):
        return None


def _check_same_model(record: ModelRecord | None, args, path: str, finetune: bool):
    """Every field that changes what the model computes must agree (a resume continues the same function); a
    fine-tune (weights only) may change the others (e.g. rope_theta for a longer context), with a warning naming
    them, but never the fields that shape the weights."""
    if record is None:
        raise CheckpointMismatch(f"{path}: not a megatron-glm5 checkpoint (no model description); "
                                 "convert HF weights with tools/convert_hf_to_megatron.py")
    if record.model_fingerprint is not None and record.model_fingerprint == model_fingerprint(args.model_config):
        return
    saved, current = _saved_description(record), model_description(args.model_config)
    if saved is None:  # a config.json this version cannot read: compare the fields that shape the weights
        hf = args.model_config.to_hf()
        saved = {f: record.model_config[f] for f in ARCH_FIELDS if f in record.model_config}
        current = {f: hf.get(f) for f in saved}
    differ = differing_fields(saved, current)
    if not differ:
        return
    shapes = [f for f in differ if f in ARCH_FIELDS]
    if finetune and not shapes:
        log.warning("--load %s: fine-tuning the checkpoint's weights as another model (%s; the model from %s)",
                    path, describe_difference(saved, current), _model_source(args))
        return
    first = (shapes or differ)[0]
    rest = [f for f in differ if f != first]
    also = ""
    if rest:
        also = f" (also differ: {describe_difference({f: saved[f] for f in rest}, {f: current[f] for f in rest})})"
    if shapes:
        advice = "the weights do not fit this model: use the checkpoint's model (leave out --preset/--hf-config)"
    else:
        advice = ("resume with the checkpoint's model (leave out --preset/--hf-config), or pass --finetune to start "
                  "a new run from its weights with this model")
    raise CheckpointMismatch(f"--load {path}: checkpoint has {first}={saved.get(first)!r} but the model "
                             f"({_model_source(args)}) has {current.get(first)!r}{also}; {advice}")


def _saved_global_batch(record: ModelRecord, path: str) -> int | None:
    """The checkpoint's global batch: recorded, or in the args of its manifest (older checkpoints)."""
    if record.global_batch_size is not None:
        return record.global_batch_size
    try:
        value = checkpoint_manifest.read_manifest(path).get("args", {}).get("global_batch_size")
    except (OSError, ValueError, CheckpointFormatError):
        return None
    return value if isinstance(value, int) else None


def _resume_global_batch(record: ModelRecord, args, path: str, scheduler) -> None:
    """A resume keeps the checkpoint's global batch (its LR schedule and data position count its samples) unless
    --global-batch-size is given; the default (micro-batch x data-parallel size) follows the layout, which may
    have changed."""
    saved = _saved_global_batch(record, path)
    if saved is None or saved == args.global_batch_size:
        return
    if "global_batch_size" in _explicit(args):
        log.warning("resuming with --global-batch-size %d; the checkpoint trained with %d (its LR schedule, counted "
                    "in samples, continues at %d samples per iteration)", args.global_batch_size, saved,
                    args.global_batch_size)
        return
    per_step = args.micro_batch_size * args.data_parallel_size
    if saved % per_step:
        raise CheckpointMismatch(
            f"--load {path}: the checkpoint's global batch {saved} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = {per_step}; pass "
            f"--global-batch-size (a multiple of {per_step}) to change the batch, or another --micro-batch-size")
    log.info("global batch %d (the checkpoint's; this layout's default would be %d): %d micro-batch(es) of %d per "
             "rank and step", saved, args.global_batch_size, saved // per_step, args.micro_batch_size)
    args.global_batch_size, args.num_microbatches = saved, saved // per_step
    if scheduler is not None:
        rescale_scheduler(scheduler, args)


def _check_model_tensors(model_sd: dict, path: str, fresh_mtp: bool = False) -> set:
    """Every tensor of this model must be in the checkpoint (say which is not, instead of dist_checkpointing's
    KeyError listing the whole checkpoint) -- except, with ``fresh_mtp`` (--mtp asked for on a checkpoint without
    MTP weights), the MTP layer's, which keep their fresh initialisation. Returns the keys of the checkpoint's
    tensors."""
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = load_tensors_metadata(path)
    missing = sorted({t.key for t in nested_values(model_sd) if isinstance(t, ShardedTensor) and t.key not in saved})
    if not missing or (fresh_mtp and all(k.startswith("mtp.") for k in missing)):
        return set(saved)
    hint = ""
    if all(k.startswith("mtp.") for k in missing):
        hint = " (it was saved without the MTP layer: pass --no-mtp)"
    raise CheckpointMismatch(f"--load {path}: the checkpoint lacks {len(missing)} tensor(s) of this model, e.g. "
                             f"{missing[0]}{hint}")


def _drop_unsaved(state: dict, saved_keys: set) -> None:
    """Leave out of the load request the model entries the checkpoint does not hold (a fresh MTP layer)."""
    for chunk in (k for k in state if k.startswith("model")):
        for name in [n for n, t in state[chunk].items() if getattr(t, "key", None) not in saved_keys
                     and getattr(t, "key", "").startswith("mtp.")]:
            del state[chunk][name]


def _loaded_model_tensors(state: dict, loaded: dict) -> dict:
    """{checkpoint key: loaded tensor} of the model's tensors (the request ``state``, its result ``loaded``)."""
    out = {}
    for chunk in (k for k in state if k.startswith("model")):
        for name, t in state[chunk].items():
            if isinstance(t, optimizer_state.TENSOR_TYPES()) and torch.is_tensor(loaded[chunk].get(name)):
                out[t.key] = loaded[chunk][name]
    return out


def resolve_load_dir(load: str) -> tuple[str, int | None]:
    """--load accepts a --save root or one iteration directory. Collective (verification is split over ranks).

    In a --save root the newest checkpoint whose manifest and files verify is chosen; a newer one that is
    incomplete or damaged is skipped with a warning naming the file and what is wrong; none good is an error.
    A root of checkpoints written before manifests existed uses the latest pointer unverified. An iteration
    directory is verified when it has a manifest (converted checkpoints have none) and refused when damaged."""
    if not os.path.isdir(load):
        raise CheckpointMismatch(f"--load {load}: no such directory")
    if os.path.isfile(os.path.join(load, MEGATRON_METADATA_FILE)) or os.path.isfile(
            os.path.join(load, checkpoint_manifest.MANIFEST)):
        if os.path.isfile(os.path.join(load, checkpoint_manifest.MANIFEST)):
            problems = checkpoint_manifest.verify(load)
            if problems:
                raise CheckpointMismatch(f"--load {load}: damaged checkpoint: {'; '.join(problems)}")
        return load, iteration_of(load)
    dirs = _from_rank0(complete_dirs(load))
    try:
        pointer = read_latest(load)
    except CheckpointFormatError as e:
        if not dirs:
            raise
        log.warning("%s; choosing among the checkpoints by their manifests", e)
        pointer = None
    if dirs and not any(os.path.isfile(os.path.join(p, checkpoint_manifest.MANIFEST)) for _, p in dirs):
        if pointer is None:
            raise CheckpointMismatch(f"--load {load}: no {LATEST} and no checkpoint manifest")
        path = pointed_dir(load, pointer)
        log.warning("--load %s: checkpoints without %s (written by an older version): loading %s unverified",
                    load, checkpoint_manifest.MANIFEST, path)
        return path, pointer
    skipped = []
    for it, path in dirs:
        problems = checkpoint_manifest.verify(path)
        if not problems:
            for partial in partial_dirs(load):
                if partial > path:
                    log.warning("ignoring %s: an incomplete save (interrupted before its manifest)", partial)
            if skipped:
                log.warning("--load %s: resuming from %s, the newest complete checkpoint", load, path)
            elif pointer is not None and pointer != it:
                log.warning("--load %s: %s points to iteration %d; %s is newer and complete: resuming from it",
                            load, LATEST, pointer, path)
            return path, it
        skipped.append(f"{path}: {'; '.join(problems)}")
        log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
    if skipped:
        raise CheckpointMismatch(f"--load {load}: no usable checkpoint: {' | '.join(skipped)}")
    partials = partial_dirs(load)
    if partials:
        raise CheckpointMismatch(f"--load {load}: no complete checkpoint, only interrupted saves "
                                 f"({', '.join(os.path.basename(p) for p in partials)})")
    raise CheckpointMismatch(f"--load {load}: neither a checkpoint directory nor a --save root "
                             f"(no {LATEST}, no metadata.json, no iter_* checkpoint)")


def _set_group_lrs(optimizer, schedule) -> None:
    """Set every parameter group's max_lr/min_lr (what the LR scheduler reads per group) from ``schedule``."""
    if not schedule or "max_lr" not in schedule:
        return
    for group in optimizer.param_groups:
        group["max_lr"], group["min_lr"] = schedule["max_lr"], schedule["min_lr"]


def _warn_if_schedule_flags_ignored(scheduler, args) -> None:
    """A resumed run follows the checkpoint's LR schedule; say so when flags given explicitly ask for another."""
    if args.override_opt_param_scheduler:
        return
    explicit, gbs = _explicit(args), args.global_batch_size
    differs = [f"--{dest.replace('_', '-')} {mine:g} (checkpoint: {theirs:g})" for dest, mine, theirs in
               (("lr", args.lr, scheduler.max_lr), ("min_lr", args.min_lr, scheduler.min_lr),
                ("lr_warmup_iters", args.lr_warmup_iters, scheduler.lr_warmup_steps / gbs),
                ("lr_decay_iters", args.lr_decay_iters, scheduler.lr_decay_steps / gbs))
               if mine != theirs and (dest in explicit or (dest == "lr_warmup_iters"
                                                           and "lr_warmup_fraction" in explicit))]
    if "lr_decay_style" in explicit and args.lr_decay_style != scheduler.lr_decay_style:
        differs.append(f"--lr-decay-style {args.lr_decay_style} (checkpoint: {scheduler.lr_decay_style})")
    if differs:
        log.warning("resuming with the checkpoint's learning-rate schedule, not %s; pass "
                    "--override-opt-param-scheduler to use the flags", ", ".join(differs))


def _load_optimizer_request(optimizer, model_sd: dict, common: dict, path: str, saved_keys):
    """The optimizer's part of the load request, and how to finish it: (request, from_model, saved kind). A
    checkpoint of the other optimizer kind (--use-distributed-optimizer switched) is read through
    optimizer_state.py."""
    request = optimizer.sharded_state_dict(model_sd, is_loading=True,
                                           metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    saved = optimizer_state.saved_kind(common.get("optimizer"))
    if saved is None or saved == optimizer_state.kind(optimizer):
        return request, [], None
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    model_keys = {t.key for t in nested_values(model_sd) if isinstance(t, optimizer_state.TENSOR_TYPES())}
    log.info("--load %s: the optimizer state was written by the %s optimizer, this run uses the %s one "
             "(--use-distributed-optimizer): converting it", path, saved, optimizer_state.kind(optimizer))
    return request, optimizer_state.retarget(request, saved_keys, model_keys), saved


def load_checkpoint(load: str, model_chunks, optimizer, scheduler, args) -> dict:
    """Load into the model (and, unless --finetune/--no-load-optim, optimizer, scheduler, RNG, data position).

    Returns {"iteration", "data_state"}; both empty/0 for --finetune.
    """
    path, chosen = resolve_load_dir(load)
    if (chosen is not None and path != load and getattr(args, "save", None)
            and os.path.realpath(args.save) == os.path.realpath(load) and read_latest(load) != chosen):
        # e.g. a crash between a save's rename and its pointer update: the pointer names the checkpoint in use
        if _rank0():
            write_latest(load, chosen)
        _barrier()
        log.warning("%s now points to iteration %d", os.path.join(load, LATEST), chosen)
    common = dist_checkpointing.load_common_state_dict(path)
    record = ModelRecord.from_common(common)
    finetune = args.finetune
    if record is not None and not finetune and record.mode == "converted":
        log.info("--load %s is a converted HF checkpoint (weights only): loading it as with --finetune", path)
        finetune = True
    _check_same_model(record, args, path, finetune)
    if not finetune:
        _resume_global_batch(record, args, path, scheduler)
    state = _model_sharded_state(model_chunks)
    model_sd = state["model"] if "model" in state else dict(state)
    fresh_mtp = bool(getattr(args, "fresh_mtp", False))
    saved_keys = _check_model_tensors(model_sd, path, fresh_mtp)
    if fresh_mtp:
        _drop_unsaved(state, saved_keys)
    load_optim = load_sched = not finetune and not args.no_load_optim
    saved_trainable = record.trainable if record.trainable is not None else trainable_of(args)
    if load_optim and saved_trainable != trainable_of(args):
        # e.g. --dsa-stage dense-warmup -> sparse: the checkpoint's optimizer state covers other parameters
        log.warning("the checkpoint's optimizer state is for %s parameters, this run trains %s (--dsa-stage / "
                    "--freeze-indexer changed): the optimizer state starts fresh; weights, iteration, LR schedule, "
                    "RNG and data position are restored", saved_trainable, trainable_of(args))
        load_optim = False
    same_layout = record.layout == layout_of(args)
    load_rng = not finetune and not args.no_load_rng and same_layout
    if load_optim:
        muon_flags.check_resume(common.get(muon_flags.OPTIMIZER_FORM_KEY), args, path)
        ensure_optimizer_state(optimizer)
        # megatron-core pairs saved and current parameter groups by their max_lr/min_lr among other keys: build the
        # groups with the checkpoint's values so that a resume with other --lr/--min-lr flags still loads
        _set_group_lrs(optimizer, common.get("scheduler"))
        state["optimizer"], from_model, saved_kind = _load_optimizer_request(optimizer, model_sd, common, path,
                                                                             saved_keys)
    if load_rng:
        state["rng_state"] = _rng_sharded_object()
    loaded = dist_checkpointing.load(state, path)
    for key, chunk in zip(sorted(k for k in loaded if k.startswith("model")), model_chunks):
        result = chunk.load_state_dict(loaded[key], strict=False)
        scope = getattr(chunk, "checkpoint_scope", None)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")
                   and not (fresh_mtp and k.startswith("mtp.")) and not (scope is not None and scope.excludes(k))]
        if missing:
            raise CheckpointMismatch(f"--load {path}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    if load_optim:
        optimizer_sd = loaded["optimizer"]
        if saved_kind is not None:
            optimizer_state.fill_from_model(optimizer_sd, from_model, _loaded_model_tensors(state, loaded))
            try:
                optimizer_sd = optimizer_state.convert(optimizer_sd, optimizer, saved_kind)
            except KeyError as e:
                raise CheckpointMismatch(f"--load {path}: cannot convert the {saved_kind} optimizer's state for "
                                         f"this run's optimizer ({e.args[0]}); pass --no-load-optim to start the "
                                         "optimizer afresh") from None
        optimizer.load_state_dict(optimizer_sd)
    elif optimizer is not None:  # (tools load weights without an optimizer)
        # bf16/fp16 optimizers keep fp32 main copies of the parameters, made when the optimizer was built (from the
        # random initialisation); without this the first step would copy them back over the loaded weights.
        optimizer.reload_model_params()
    if finetune:
        log.info("loaded weights from %s (--finetune: optimizer, schedule and data position start fresh)", path)
        return {"iteration": 0, "data_state": {}}
    if load_sched:
        # the scheduler computes each group's LR from the group's max_lr/min_lr: the checkpoint's, or the flags'
        _set_group_lrs(optimizer, {"max_lr": args.lr, "min_lr": args.min_lr} if args.override_opt_param_scheduler
                       else common.get("scheduler"))
        scheduler.load_state_dict(loaded["scheduler"])
        _warn_if_schedule_flags_ignored(scheduler, args)
    if load_rng:
        _restore_rng(loaded["rng_state"])
    elif not same_layout:
        log.warning("checkpoint layout %s differs from this run's %s: RNG states not restored",
                    record.layout, layout_of(args))
    log.info("resumed from %s at iteration %d", path, loaded["iteration"])
    return {"iteration": loaded["iteration"], "data_state": loaded.get("data_state", {})}
