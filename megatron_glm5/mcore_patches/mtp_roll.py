"""Patch of megatron-core's MTP token roll: exact under context parallelism (model/context_parallel.py)."""
from __future__ import annotations

from megatron_glm5.mcore_patches.record import Patch, Phase

_MCORE_ROLL = None  # megatron-core's own roll_tensor, once replaced


def _mtp_roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    """megatron-core's ``multi_token_prediction.roll_tensor`` with an exact context-parallel path.

    megatron-core 0.19.2's own CP roll is right for unpacked rows but assumes per-document CP splitting for
    packed ones, and ``process_mtp_loss`` scales the per-token MTP loss by original / rolled token count of the
    local tokens only. Here the roll is done on the gathered global sequence, and the count returned (which
    megatron-core uses only as that rolled token count) is the local count times the global rolled / original
    ratio, so that its original / rolled factor is the global one, as in a one-rank run. (A rank whose own loss
    mask is all zero still drops the at most 2 rolled-in targets at its chunk ends: megatron-core multiplies
    by its original count, 0. Per-token loss only: training always uses it.)"""
    if tensor is None or cp_group is None or cp_group.size() == 1:
        return _MCORE_ROLL(tensor, shifts=shifts, dims=dims, cp_group=cp_group, packed_seq_params=packed_seq_params)
    if shifts != -1 or dims not in (-1, tensor.dim() - 1):
        raise NotImplementedError("context-parallel MTP roll: only a one-token left shift of the last dimension")
    from megatron_glm5.model.context_parallel import roll_left

    cu = packed_seq_params.cu_seqlens_q if packed_seq_params is not None else None
    local, full, rolled = roll_left(tensor, cp_group, cu)
    count = tensor.sum() * (rolled.sum() / full.sum().clamp(min=1))
    return local, count


def _mtp_roll_tensor_cp(tcfg) -> bool:
    """megatron/core/transformer/multi_token_prediction.py, roll_tensor (module global, called by the MTP block
    for tokens, labels and the loss mask): replaced by :func:`_mtp_roll_tensor` when the layout ``tcfg`` has
    context parallelism and MTP (the only layouts that call its CP path); False otherwise."""
    global _MCORE_ROLL
    if tcfg.context_parallel_size == 1 or not tcfg.mtp_num_layers:
        return False
    from megatron.core.transformer import multi_token_prediction as mtp

    if mtp.roll_tensor is not _mtp_roll_tensor:
        _MCORE_ROLL = mtp.roll_tensor
        mtp.roll_tensor = _mtp_roll_tensor
    return True


PATCHES = (
    Patch(
        name="mtp_roll_tensor_cp",
        site="megatron/core/transformer/multi_token_prediction.py roll_tensor",
        why="under --cp its packed-row roll assumes per-document splitting (IndexError) and the MTP loss scale "
            "counts local tokens only (gradient norm off by 8e-4)",
        test="tests/test_layouts_cp.py::test_cp2_matches_single_process[indexshare-packed]",
        phase=Phase.ON_USE, applied_by="model/model.py build_model (does nothing without --cp > 1 and MTP)",
        apply=_mtp_roll_tensor_cp),
)
