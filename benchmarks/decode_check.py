"""Cached decode against full forwards on the GPU, per dtype / DSA stage / backend (the check behind
docs/performance.md's decode rows): GLM-5.3 width, 2 layers, random weights, 8 greedy tokens after a 1,024- and a
3,000-token prompt (past index_topk 2048); prints one JSON line per case with the greedy agreement and the last
step's max-abs relative logits difference (benchmarks/decode.py's run_one).

    python benchmarks/decode_check.py
"""
import json
import os
import sys

import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import decode as D
from megatron_glm5.model.model import build_model
dev = torch.device("cuda")
cfg = D.proxy_config("glm5.3", 2, 1)
for dtype, stage, attn in [(torch.bfloat16, "sparse", "torch"), (torch.bfloat16, "dense-warmup", "torch"),
                           (torch.float32, "sparse", "torch"), (torch.bfloat16, "sparse", "triton"),
                           (torch.float32, "sparse", "triton")]:
    torch.manual_seed(0)
    with torch.device(dev):
        m = build_model(cfg, mtp=False, params_dtype=dtype, bf16=dtype == torch.bfloat16, dsa_backend=attn,
                        dsa_stage=stage).eval()
    for plen in (1024, 3000):
        r = D.run_one(m, cfg, 1, plen, 8, dev)
        print(json.dumps({"dtype": str(dtype), "stage": stage, "attn": attn, "prompt": plen,
                          "agree": r["check_greedy_agreement"], "last_rel": r["check_last_logits_rel_diff"]}), flush=True)
    del m; torch.cuda.empty_cache()
