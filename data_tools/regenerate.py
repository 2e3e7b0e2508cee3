"""Regenerate assistant answers with the target: prompts -> JSONL in input order (resumable)."""

import argparse
import logging
import os

from deepspec.data.openai_backend import OpenAIChatBackend
from deepspec.data.regenerate import LocalBackend, regenerate_conversations
from deepspec.data.sources import load_prompts, prompt_source_paths, require_conversations

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--prompts", default="sharegpt", help="sharegpt | path.jsonl | path.json | hf:name[:split]")
p.add_argument("--limit", type=int), p.add_argument("--out", required=True)
p.add_argument("--target", default="smollm2-135m"), p.add_argument("--device"), p.add_argument("--dtype")
p.add_argument("--backend", choices=["local", "openai"], default="local")
p.add_argument("--base-url"), p.add_argument("--model")
p.add_argument("--api-key-env", help="environment variable holding the API key (default OPENAI_API_KEY; the key "
               "is never taken from the command line, where ps shows it)")
p.add_argument("--timeout", type=float, default=600.0, help="total seconds per request attempt (openai backend)")
p.add_argument("--retries", type=int, default=5, help="retries of a failed or malformed request (openai backend)")
p.add_argument("--concurrency", type=int, default=8), p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=2048), p.add_argument("--temperature", type=float, default=0.0)
p.add_argument("--top-p", type=float, default=1.0), p.add_argument("--top-k", type=int, default=0)
p.add_argument("--max-turns", type=int), p.add_argument("--max-prompt-tokens", type=int)
p.add_argument("--seed", type=int, default=0), p.add_argument("--system-prompt")
args = p.parse_args()
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

conversations, load_report = load_prompts(args.prompts, limit=args.limit)
require_conversations(conversations, load_report, "--prompts")
if args.backend == "openai":
    if not args.base_url or not args.model:
        p.error("--backend openai needs --base-url and --model")
    api_key = os.environ.get(args.api_key_env or "OPENAI_API_KEY")
    if args.api_key_env and api_key is None:
        p.error(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    backend = OpenAIChatBackend(args.base_url, args.model, api_key=api_key,
                                concurrency=args.concurrency, max_retries=args.retries, timeout=args.timeout)
else:
    from deepspec.targets.load import load_target

    target = load_target(args.target, dtype=args.dtype, device=args.device)
    backend = LocalBackend(target.model, target.tokenizer, max_prompt_tokens=args.max_prompt_tokens)
report = regenerate_conversations(
    conversations, backend, args.out, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
    top_p=args.top_p, top_k=args.top_k, batch_size=args.batch_size, system_prompt=args.system_prompt,
    max_turns=args.max_turns, seed=args.seed, input_paths=prompt_source_paths(args.prompts))
print(report.summary())
