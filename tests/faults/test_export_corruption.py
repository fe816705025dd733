"""The export verifies what it reads (issue 21, class 1): tools/convert_megatron_to_hf.py and
tools/verify_conversion.py check a training checkpoint against its manifest before reading it.

One tiny training checkpoint (finetune_glm5.py, 1 step, ~8 s) is built per module and exported once as the
reference. Then:
- the issue's reproductions: one bit flipped inside a model tensor of ``__0_0.distcp`` (exit 0 with a weight of
  ~1e36 before), a truncated data file, a garbage manifest: refused with one line naming the file; ``--no-verify``
  exports anyway with one warning; a checkpoint without a manifest exports (warning) as before;
- the fault harness: 20 seeded random corruptions (byte flips, truncations, garbage) of random files of the --save
  root; each export is refused with one ``error:`` line naming what is damaged, or exported with every tensor
  bitwise equal to the reference export (damage the converter does not read: TensorBoard events, run.json, ...).
  The seed is in every failure message (rerun one with ``-k 'corruption and SEED'``).
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training_helpers import REPO, describe, run_entry  # noqa: E402

TRAIN = ["--preset", "tiny", "--train-iters", "1", "--tokenizer", "tiny", "--attn", "torch", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0", "--num-workers", "0",
         "--log-interval", "1"]
ITER = "iter_0000001"
SEEDS = list(range(20))


def _read_hf(directory) -> dict:
    from megatron_glm5.conversion.safetensors_stream import SafetensorsSource

    src = SafetensorsSource(str(directory))
    try:
        return {k: src.read_rows(k) for k in src.keys()}
    finally:
        src.close()


def _bitwise_equal(a: dict, b: dict) -> list:
    """Names that differ (or exist on one side only); [] when every tensor is bitwise equal."""
    if sorted(a) != sorted(b):
        return sorted(set(a) ^ set(b))
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))]


def _export(load, save, *flags):
    """tools/convert_megatron_to_hf.py's main in process: (exit status, stderr lines)."""
    from megatron_glm5.conversion.cli import megatron_to_hf_main

    import io
    from contextlib import redirect_stderr, redirect_stdout

    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        rc = megatron_to_hf_main(["--load", str(load), "--save", str(save), "--no-progress", *flags])
    return rc, err.getvalue().strip().splitlines()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(clean --save root, its reference export's tensors, the model tensors' byte ranges in __0_0.distcp)."""
    from megatron_glm5.conversion.torch_dist_stream import TorchDistReader

    work = tmp_path_factory.mktemp("export_faults")
    root = work / "save"
    proc = run_entry("finetune", [*TRAIN, "--save", str(root)], cwd=work)
    assert proc.returncode == 0, describe(proc)
    assert (root / ITER / "manifest.json").is_file()
    rc, err = _export(root, work / "ref")
    assert rc == 0, err
    reader = TorchDistReader(str(root / ITER))
    spans = []
    for key in reader.tensor_keys():
        if "optimizer" in key:
            continue
        for _, _, info in reader._chunks[key]:
            record, start = reader._record(info)  # where the tensor's bytes lie inside its torch.save record
            spans.append((key, start, start + math.prod(record.size) * record.dtype.itemsize))
    reader.close()
    return root, _read_hf(work / "ref"), spans


def _copy(root, dst) -> Path:
    shutil.copytree(root, dst)
    return Path(dst)


# ----------------------------------------------------------------------------------- the reproductions
def test_flipped_bit_in_a_model_tensor_is_refused_and_no_verify_exports_it(trained, tmp_path, caplog):
    root, ref, spans = trained
    bad = _copy(root, tmp_path / "bad")
    key, lo, _ = next(s for s in spans if s[0] == "embedding.word_embeddings.weight")
    path = bad / ITER / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[lo + 3] ^= 0x40  # the exponent's top bit of the first weight: ~1e36
    path.write_bytes(bytes(data))
    rc, err = _export(bad, tmp_path / "out")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: --load ") and "__0_0.distcp: sha256 mismatch (corrupted)" in err[0], err
    assert "--no-verify" in err[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    # --no-verify: exported as it is, said once
    caplog.clear()
    rc, err = _export(bad, tmp_path / "out", "--no-verify")
    assert rc == 0, err
    warned = [r.getMessage() for r in caplog.records if "--no-verify" in r.getMessage()]
    assert len(warned) == 1 and "not checked against its manifest" in warned[0]
    got = _read_hf(tmp_path / "out")
    differ = _bitwise_equal(got, ref)  # the embedding and its MTP copy, nothing else
    assert "model.embed_tokens.weight" in differ and all(k.endswith("embed_tokens.weight") for k in differ), differ
    assert got["model.embed_tokens.weight"].abs().max() > 1e30


@pytest.mark.parametrize("damage", ["truncated_data", "garbage_manifest", "empty_manifest"])
def test_damage_outside_the_model_tensors_is_refused_too(trained, tmp_path, damage):
    root, _, _ = trained
    bad = _copy(root, tmp_path / "bad")
    d = bad / ITER
    if damage == "truncated_data":  # the end of the file: the optimizer state
        path, name = d / "__0_0.distcp", "__0_0.distcp"
        path.write_bytes(path.read_bytes()[:-1000])
        words = [f"{name}: ", "truncated"]
    elif damage == "garbage_manifest":
        (d / "manifest.json").write_bytes(os.urandom(300))
        words = ["manifest.json unreadable"]
    else:
        (d / "manifest.json").write_text(json.dumps({"files": {}}))
        words = ["manifest.json is not a megatron-glm5 checkpoint manifest"]
    rc, err = _export(bad, tmp_path / "out")
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for w in words:
        assert w in err[0], (w, err[0])
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_checkpoint_without_a_manifest_exports_unverified_with_a_warning(trained, tmp_path, caplog):
    root, ref, _ = trained
    old = _copy(root, tmp_path / "old")
    (old / ITER / "manifest.json").unlink()
    rc, err = _export(old, tmp_path / "out")
    assert rc == 0, err
    assert any("no manifest.json" in r.getMessage() and "unverified" in r.getMessage() for r in caplog.records)
    assert _bitwise_equal(_read_hf(tmp_path / "out"), ref) == []


def test_verify_tool_checks_the_manifest(trained, tmp_path, capsys):
    from megatron_glm5.conversion.cli import verify_main

    root, _, spans = trained
    ref_dir = tmp_path / "ref"
    assert _export(root, ref_dir)[0] == 0
    capsys.readouterr()
    assert verify_main(["--hf-dir", str(ref_dir), "--megatron", str(root)]) == 0
    assert "verify: OK" in capsys.readouterr().out
    bad = _copy(root, tmp_path / "bad")
    _, lo, _ = spans[0]
    path = bad / ITER / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[lo] ^= 1
    path.write_bytes(bytes(data))
    assert verify_main(["--hf-dir", str(ref_dir), "--megatron", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --load ") and "__0_0.distcp: sha256 mismatch" in err[0]
    assert verify_main(["--hf-dir", str(ref_dir), "--megatron", str(bad), "--no-verify"]) == 1  # the difference
    assert "DIFFERENT" in capsys.readouterr().out


def test_real_command_refuses_a_damaged_checkpoint(trained, tmp_path):
    root, _, spans = trained
    bad = _copy(root, tmp_path / "bad")
    path = bad / ITER / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[spans[-1][1]] ^= 0x10
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_megatron_to_hf.py"), "--load", str(bad),
                           "--save", str(out)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --load ") and "sha256 mismatch" in lines[0], lines
    assert not out.exists() and not (tmp_path / "out.partial").exists()


# ----------------------------------------------------------------------------------- the fault harness
def _corrupt(root: Path, spans, rng: random.Random) -> str:
    """Damage one random file of the --save root (half the time one of the checkpoint directory's files); returns
    a description and the file's name. Kinds: a flipped bit (in the data file, half of them inside a model tensor),
    a truncation, random garbage over a range."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    data_files = [p for p in files if p.parent.name == ITER]
    path = rng.choice(data_files) if rng.random() < 0.5 else rng.choice(files)
    data = bytearray(path.read_bytes())
    kind = rng.choice(["flip", "flip", "truncate", "garbage"]) if data else "garbage"
    rel = path.relative_to(root)
    if kind == "flip":
        if path.name == "__0_0.distcp" and rng.random() < 0.5:
            key, lo, hi = rng.choice(spans)
            at = rng.randrange(lo, hi)
            where = f"inside {key}"
        else:
            at, where = rng.randrange(len(data)), "anywhere"
        data[at] ^= 1 << rng.randrange(8)
        desc = f"bit flip at byte {at} of {rel} ({where})"
    elif kind == "truncate":
        n = rng.randrange(len(data))
        data = data[:n]
        desc = f"{rel} truncated to {n} bytes"
    else:
        n = rng.randrange(1, 200)
        at = rng.randrange(len(data) + 1)
        data[at:at + n] = bytes(rng.randrange(256) for _ in range(n))
        desc = f"{n} garbage bytes at {at} of {rel}"
    path.write_bytes(bytes(data))
    return desc, path.name


@pytest.mark.parametrize("seed", SEEDS)
def test_export_of_a_randomly_corrupted_checkpoint(trained, tmp_path, seed):
    root, ref, spans = trained
    bad = _copy(root, tmp_path / "bad")
    what, name = _corrupt(bad, spans, random.Random(seed))
    out = tmp_path / "out"
    try:
        rc, err = _export(bad, out)
    except BaseException as e:  # noqa: BLE001 - a traceback is the failure this test looks for
        pytest.fail(f"seed {seed} ({what}): the export raised {type(e).__name__}: {e}")
    if rc == 2:
        assert len(err) == 1 and err[0].startswith("error: "), f"seed {seed} ({what}): {err}"
        # names the damaged file (a damaged manifest may name the file whose entry it garbled)
        assert name in err[0] or name == "manifest.json", f"seed {seed} ({what}): does not name {name}: {err[0]}"
        assert not out.exists() and not Path(str(out) + ".partial").exists(), f"seed {seed} ({what}): left output"
        print(f"seed {seed}: {what}: refused: {err[0][:200]}")
        return
    assert rc == 0, f"seed {seed} ({what}): exit status {rc}: {err}"
    differ = _bitwise_equal(_read_hf(out), ref)
    assert not differ, f"seed {seed} ({what}): exported, but {len(differ)} tensor(s) differ, e.g. {differ[0]}"
    print(f"seed {seed}: {what}: exported, bitwise equal")
