"""The end-of-run summary (megatron_glm5/training/run_summary.py)."""
from __future__ import annotations

from megatron_glm5.training.run_summary import RunSummary, resume_command


def test_summary_names_counts_losses_and_next_commands():
    s = RunSummary(start_iteration=100, tokens_per_iteration=8 * 512)
    for it, loss in ((150, 1.5), (200, 1.25), (250, 1.3)):
        s.note_iteration(it)
        s.note_eval(it, loss)
    s.note_checkpoint("runs/x/iter_0000250")
    lines = s.lines(92.4, "runs/x", "runs/x/tensorboard", "finetune_glm5.py",
                    argv=["--preset", "tiny", "--save", "runs/old", "--overwrite", "--lr", "1e-4"])
    head = lines[0]
    assert head.startswith("run summary: 150 iterations (100 -> 250) in 1m32s, 614.40k tokens")
    assert "last 1.3000 (iter 250), best 1.2500 (iter 200)" in head
    assert "  checkpoint:  runs/x/iter_0000250" in lines
    assert any(l.startswith("  tensorboard: runs/x/tensorboard") for l in lines)
    resume = [l for l in lines if l.startswith("  resume:")][0]
    assert resume.endswith("python finetune_glm5.py --preset tiny --lr 1e-4 --load runs/x --save runs/x")
    assert any("tools/convert_megatron_to_hf.py --load runs/x" in l for l in lines)


def test_summary_without_checkpoint_or_validation():
    s = RunSummary(0, 10)
    s.note_iteration(3)
    s.note_eval(3, float("nan"))
    lines = s.lines(3600 * 2 + 5, None, None, "pretrain_glm5.py", argv=[])
    assert lines == ["run summary: 3 iterations (0 -> 3) in 2h00m05s, 30 tokens"]


def test_resume_command_drops_load_save_forms():
    cmd = resume_command("pretrain_glm5.py", "r d", ["--load=a", "--save", "b", "--finetune", "--ep", "2"])
    assert cmd == "python pretrain_glm5.py --ep 2 --load 'r d' --save 'r d'"
