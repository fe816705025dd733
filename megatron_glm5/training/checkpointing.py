"""Checkpoints in megatron-core's dist_checkpointing format (torch_dist), written atomically.

Layout of ``--save DIR``::

    DIR/iter_0000100/              a complete checkpoint (model, optimizer, scheduler, RNG, data position, args)
    DIR/latest_checkpointed_iteration.txt

A checkpoint is written to ``iter_XXXXXXX.partial`` and renamed when every rank has finished, then the
``latest`` pointer is replaced (write + rename); a crash mid-save leaves the previous checkpoint and pointer
untouched, and a stale ``.partial`` is removed by the next save. Sharded tensors carry global shapes and
offsets, so a checkpoint loads into any parallel layout that divides the model (``fully_reshardable``).
"""
from __future__ import annotations

import logging
import os
import queue
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_glm5.errors import UserError
from megatron_glm5.training.optim import ensure_optimizer_state

log = logging.getLogger("megatron_glm5.checkpoint")
LATEST = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1
# model fields that must match between a checkpoint and the model it is loaded into
ARCH_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
               "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "index_n_heads", "index_head_dim",
               "mlp_layer_types", "indexer_types")


class CheckpointMismatch(UserError, ValueError):
    """The checkpoint does not belong to this model (or is not a megatron-glm5 checkpoint)."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest(root: str):
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointMismatch(f"{path}: expected an iteration number, found {text!r}")
    return int(text)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _model_sharded_state(model_chunks) -> dict:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(model_chunks)}


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
    if args.dsa_stage == "dense-warmup":
        return "indexer-only"  # the warm-up trains the lightning indexers alone
    return "all-but-indexer" if args.freeze_indexer else "all"


def layout_of(args) -> dict:
    return {k: getattr(args, k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                           "expert_model_parallel_size", "expert_tensor_parallel_size",
                                           "context_parallel_size", "data_parallel_size")}


def _in_process_results_queue():
    """dist_checkpointing's writer returns its results through a multiprocessing Manager queue that the first
    save creates: a spawned server process per rank (seconds to start) that only an asynchronous save needs.
    Our saves are synchronous (the writer threads run in this process), so an in-process queue serves."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler, args, data_state: dict) -> str:
    final = iteration_dir(root, iteration)
    partial = final + ".partial"
    if _rank0():
        os.makedirs(root, exist_ok=True)
        if os.path.exists(partial):
            shutil.rmtree(partial)
        os.makedirs(partial)
    _barrier()
    state = _model_sharded_state(model_chunks)
    model_sd = state["model"] if "model" in state else {k: v for k, v in state.items()}
    state["optimizer"] = optimizer.sharded_state_dict(
        model_sd, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    state["scheduler"] = scheduler.state_dict()
    state["iteration"] = iteration
    state["data_state"] = data_state
    state["rng_state"] = _rng_sharded_object()
    state["glm5"] = {"format_version": FORMAT_VERSION, "model_config": args.model_config.to_hf(),
                     "layout": layout_of(args), "mode": args.mode, "trainable": trainable_of(args)}
    _in_process_results_queue()
    dist_checkpointing.save(state, partial)
    _barrier()
    if _rank0():
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        tmp = os.path.join(root, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, LATEST))
    _barrier()
    return final


def _check_same_model(meta: dict, args, path: str):
    if not meta or "model_config" not in meta:
        raise CheckpointMismatch(f"{path}: not a megatron-glm5 checkpoint (no model description); "
                                 "convert HF weights with tools/convert_hf_to_megatron.py")
    saved = meta["model_config"]
    current = args.model_config.to_hf()
    for field in ARCH_FIELDS:
        if field in saved and saved[field] != current.get(field):
            raise CheckpointMismatch(f"--load {path}: checkpoint has {field}={saved[field]!r} but the model "
                                     f"(--preset/--hf-config) has {current.get(field)!r}")


def _check_model_tensors(model_sd: dict, path: str):
    """Every tensor of this model must be in the checkpoint (say which is not, instead of dist_checkpointing's
    KeyError listing the whole checkpoint)."""
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = load_tensors_metadata(path)
    missing = sorted({t.key for t in nested_values(model_sd) if isinstance(t, ShardedTensor) and t.key not in saved})
    if not missing:
        return
    hint = ""
    if all(k.startswith("mtp.") for k in missing):
        hint = " (it was saved without the MTP layer: pass --no-mtp)"
    raise CheckpointMismatch(f"--load {path}: the checkpoint lacks {len(missing)} tensor(s) of this model, e.g. "
                             f"{missing[0]}{hint}")


def resolve_load_dir(load: str) -> tuple[str, int | None]:
    """--load accepts a --save root (uses the latest pointer) or one iteration directory."""
    if not os.path.isdir(load):
        raise CheckpointMismatch(f"--load {load}: no such directory")
    it = read_latest(load)
    if it is not None:
        path = iteration_dir(load, it)
        if not os.path.isdir(path):
            raise CheckpointMismatch(f"{os.path.join(load, LATEST)} points to iteration {it}, but {path} is missing")
        return path, it
    if os.path.isfile(os.path.join(load, "metadata.json")):
        return load, None
    raise CheckpointMismatch(f"--load {load}: neither a checkpoint directory nor a --save root "
                             f"(no {LATEST}, no metadata.json)")


def load_checkpoint(load: str, model_chunks, optimizer, scheduler, args) -> dict:
    """Load into the model (and, unless --finetune/--no-load-optim, optimizer, scheduler, RNG, data position).

    Returns {"iteration", "data_state"}; both empty/0 for --finetune.
    """
    path, _ = resolve_load_dir(load)
    common = dist_checkpointing.load_common_state_dict(path)
    _check_same_model(common.get("glm5"), args, path)
    finetune = args.finetune
    if not finetune and common.get("glm5", {}).get("mode") == "converted":
        log.info("--load %s is a converted HF checkpoint (weights only): loading it as with --finetune", path)
        finetune = True
    state = _model_sharded_state(model_chunks)
    model_sd = state["model"] if "model" in state else dict(state)
    _check_model_tensors(model_sd, path)
    load_optim = load_sched = not finetune and not args.no_load_optim
    saved_trainable = common.get("glm5", {}).get("trainable", trainable_of(args))
    if load_optim and saved_trainable != trainable_of(args):
        # e.g. --dsa-stage dense-warmup -> sparse: the checkpoint's optimizer state covers other parameters
        log.warning("the checkpoint's optimizer state is for %s parameters, this run trains %s (--dsa-stage / "
                    "--freeze-indexer changed): the optimizer state starts fresh; weights, iteration, LR schedule, "
                    "RNG and data position are restored", saved_trainable, trainable_of(args))
        load_optim = False
    same_layout = common.get("glm5", {}).get("layout") == layout_of(args)
    load_rng = not finetune and not args.no_load_rng and same_layout
    if load_optim:
        ensure_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    if load_rng:
        state["rng_state"] = _rng_sharded_object()
    loaded = dist_checkpointing.load(state, path)
    for key, chunk in zip(sorted(k for k in loaded if k.startswith("model")), model_chunks):
        result = chunk.load_state_dict(loaded[key], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing:
            raise CheckpointMismatch(f"--load {path}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
    else:
        # bf16/fp16 optimizers keep fp32 main copies of the parameters, made when the optimizer was built (from the
        # random initialisation); without this the first step would copy them back over the loaded weights.
        optimizer.reload_model_params()
    if finetune:
        log.info("loaded weights from %s (--finetune: optimizer, schedule and data position start fresh)", path)
        return {"iteration": 0, "data_state": {}}
    if load_sched:
        scheduler.load_state_dict(loaded["scheduler"])
    if load_rng:
        _restore_rng(loaded["rng_state"])
    elif not same_layout:
        log.warning("checkpoint layout %s differs from this run's %s: RNG states not restored",
                    common.get("glm5", {}).get("layout"), layout_of(args))
    log.info("resumed from %s at iteration %d", path, loaded["iteration"])
    return {"iteration": loaded["iteration"], "data_state": loaded.get("data_state", {})}
