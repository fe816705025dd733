"""Text generation and perplexity from a GLM-5 model: the MLA latent + indexer key cache (kv_cache.py), prefill and
incremental decoding through the model's own modules (decode.py), sampling and stop tokens (sampling.py),
perplexity on a jsonl (perplexity.py), and tools/generate.py's command line (cli.py). docs/generation.md."""
