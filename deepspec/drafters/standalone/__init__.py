"""Standalone drafter: any causal LM sharing the target's tokenizer, or a small one distilled from it. `spec.SPEC`."""
