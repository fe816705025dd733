"""``megatron_glm5.load_checkpoint(dir)`` (megatron_glm5/api.py): a training checkpoint into a single-process model
for notebooks, in eval mode, the model config taken from the checkpoint's record, the manifest verified.

The checkpoint is saved by finetune_glm5.py in 2 gloo processes at TP2 x EP2 (ETP1; 2 steps, the tiny preset, MTP
on), so every tensor is stored in pieces (TP-split attention and dense MLP, one half of the experts per rank).
The loaded model is compared with two independent loads of the same checkpoint: megatron-core's own
``dist_checkpointing.load`` (resharding to one process; conversion/verify.py ``load_megatron_model``) — every
tensor bitwise and the logits equal — and the HF export (tools/convert_megatron_to_hf.py) read back by
``from_hf_pretrained``.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from layouts_harness import _train

ITER = "iter_0000002"


@pytest.fixture(scope="module")
def tp2_ep2_checkpoint(tmp_path_factory):
    work = tmp_path_factory.mktemp("load_ckpt")
    root = work / "save"
    _train(2, work / "run", "--tp", "2", "--ep", "2", "--etp", "1", "--train-iters", "2", "--save", str(root))
    record = json.loads((root / ITER / "manifest.json").read_text())
    assert record["layout"]["tensor_model_parallel_size"] == 2 and record["layout"]["expert_model_parallel_size"] == 2
    return root


def _ids(cfg):
    return torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.distributed
def test_loads_a_tp2_ep2_training_checkpoint_as_megatron_core_does(tp2_ep2_checkpoint, tmp_path):
    import megatron_glm5
    from megatron_glm5.conversion.convert import convert_megatron_to_hf
    from megatron_glm5.conversion.verify import load_megatron_model

    root = tp2_ep2_checkpoint
    model = megatron_glm5.load_checkpoint(str(root))  # the --save root: its latest pointer
    assert not model.training
    ref, cfg = load_megatron_model(str(root))  # megatron-core's dist_checkpointing.load
    ours, theirs = model.state_dict(), ref.state_dict()
    assert sorted(ours) == sorted(theirs)
    assert any(k.startswith("mtp.") for k in ours)  # the record says MTP was trained: it is loaded
    for k in ours:
        if torch.is_tensor(ours[k]):
            assert torch.equal(ours[k], theirs[k]), k
    ids = _ids(cfg)
    with torch.no_grad():
        logits = model(ids)
        assert torch.equal(logits, ref(ids))
    # the same from one iteration directory, and through the HF export
    again = megatron_glm5.load_checkpoint(str(root / ITER))
    convert_megatron_to_hf(str(root), str(tmp_path / "hf"), progress=False)
    exported = megatron_glm5.from_hf_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        assert torch.equal(again(ids), logits)
        assert torch.equal(exported(ids), logits)
    assert model.config.hidden_size == cfg.hidden_size


@pytest.mark.distributed
def test_a_damaged_checkpoint_is_refused_unless_verify_is_false(tp2_ep2_checkpoint, tmp_path):
    import megatron_glm5
    from megatron_glm5.errors import UserError

    bad = shutil.copytree(tp2_ep2_checkpoint, tmp_path / "bad")
    data_file = sorted((bad / ITER).glob("__1_*.distcp"))[0]
    data = bytearray(data_file.read_bytes())
    data[len(data) // 3] ^= 0x08
    data_file.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"{data_file.name}: sha256 mismatch \(corrupted\).*pass verify=False"):
        megatron_glm5.load_checkpoint(str(bad))
    # damage in a file the loader does not read: still refused; verify=False loads it knowingly
    data_file.write_bytes(bytes(data[:len(data) // 3]) + bytes([data[len(data) // 3] ^ 0x08]) +
                          bytes(data[len(data) // 3 + 1:]))
    (bad / ITER / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1} ')
    with pytest.raises(UserError, match=r"metadata.json: \d+ bytes, the manifest says"):
        megatron_glm5.load_checkpoint(str(bad))
    model = megatron_glm5.load_checkpoint(str(bad), verify=False, mtp=False)
    assert not any(k.startswith("mtp.") for k in model.state_dict())
