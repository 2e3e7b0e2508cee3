"""Regeneration: batched local generation vs an unbatched reference, multi-turn order, exact resume."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepspec.data.chat import end_of_turn_token_ids, prompt_ids
from deepspec.data.regenerate import (
    Generation,
    LocalBackend,
    RegenerationSettings,
    read_existing_output,
    recommended_sampling,
    regenerate_conversations,
)
from deepspec.data.rendering import Rendering
from deepspec.data.sampling import SamplingParams
from deepspec.data.sources import Conversation

GREEDY = SamplingParams(temperature=0.0)


def conv(cid, *turns, system=None):
    messages = [{"role": "system", "content": system}] if system else []
    for k, text in enumerate(turns):
        messages.append({"role": "user" if k % 2 == 0 else "assistant", "content": text})
    return Conversation(id=cid, messages=messages, source="test", line=None)


CONVS = [
    conv("a", "Hello there", "original answer", "Tell me more"),
    conv("b", "What is the capital of France?"),
    conv("c", "Write a poem about the sea, please, with rhymes.", "x", "Shorter", "y", "Thanks"),
    conv("d", "Count to three"),
    conv("e", "Why is the sky blue?", "z", "And at sunset?"),
]


class EchoBackend:
    """Deterministic fake backend that records what it was asked."""

    def __init__(self, rendering=None):
        self.calls = []
        self.rendering = rendering or Rendering()

    def describe(self):
        return {"backend": "echo"}

    def complete(self, prefixes, sampling, max_new_tokens, seed):
        self.calls.append(list(prefixes))
        return [Generation(text=f" and then {len(p)}", finish_reason="stop", num_tokens=3) for p in prefixes]

    def generate(self, conversations, sampling, max_new_tokens, seed):
        self.calls.append([[dict(m) for m in c] for c in conversations])
        return [Generation(text=f"re:{c[-1]['content']}#{sum(m['role'] == 'assistant' for m in c)}",
                           finish_reason="stop", num_tokens=2) for c in conversations]


def read_records(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


@pytest.mark.parametrize("tokenizer_fixture,template_kwargs", [
    (None, None), ("qwen3_style_tokenizer", {"enable_thinking": False})])
def test_local_backend_matches_unbatched_greedy_reference(tiny_llama, request, tokenizer_fixture, template_kwargs):
    """Also with template options (Qwen3 non-thinking): the backend prompts with them, like `prompt_ids`."""
    model = tiny_llama.model
    tokenizer = request.getfixturevalue(tokenizer_fixture) if tokenizer_fixture else tiny_llama.tokenizer
    backend = LocalBackend(model, tokenizer, rendering=Rendering(chat_template_kwargs=template_kwargs or {}))
    chats = [c.messages[:1] for c in CONVS[:3]]
    got = backend.generate(chats, GREEDY, 6, seed=0)
    stop = end_of_turn_token_ids(tokenizer)
    for messages, generation in zip(chats, got):
        ids = prompt_ids(tokenizer, messages, chat_template_kwargs=template_kwargs)
        assert ("<think>" in tokenizer.decode(ids)) == bool(template_kwargs)
        new = []
        with torch.no_grad():
            for _ in range(6):  # plain greedy loop, no padding, no cache
                token = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
                new.append(token)
                if token in stop:
                    break
        assert generation.text == tokenizer.decode([t for t in new if t not in stop], skip_special_tokens=False)
        assert generation.num_tokens == len(new)
        assert generation.finish_reason == ("stop" if new[-1] in stop else "length")


@contextlib.contextmanager
def always_token(model, token_id):
    """The model's every next token is `token_id` (its logit lifted above all others)."""
    def lift(module, inputs, logits):
        logits = logits.clone()
        logits[..., token_id] = logits.max() + 10.0
        return logits

    handle = model.lm_head.register_forward_hook(lift)
    try:
        yield
    finally:
        handle.remove()


def test_end_of_turn_token_stops_generation(tiny_llama):
    model, tokenizer = tiny_llama.model, tiny_llama.tokenizer
    with always_token(model, tokenizer.convert_tokens_to_ids("<|im_end|>")):
        got = LocalBackend(model, tokenizer).generate([CONVS[0].messages[:1], CONVS[1].messages[:1]],
                                                      GREEDY, 5, seed=0)
    assert [(g.text, g.finish_reason, g.num_tokens) for g in got] == [("", "stop", 1)] * 2


def test_multi_turn_answers_are_the_targets_own_in_input_order(tmp_path):
    backend = EchoBackend()
    convs = CONVS + [conv("no-user", "hi")]
    convs[-1].messages = [{"role": "assistant", "content": "only an answer"}]
    out = tmp_path / "out.jsonl"
    report = regenerate_conversations(convs, backend, out,
                                      RegenerationSettings(max_new_tokens=8, batch_size=2, show_progress=False))
    records = read_records(out)
    assert [r["id"] for r in records] == ["a", "b", "c", "d", "e"]
    assert report.num_no_user_turn == 1 and report.num_written == 5 and report.num_turns_generated == 9
    assert records[0]["conversations"] == [
        {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "re:Hello there#0"},
        {"role": "user", "content": "Tell me more"}, {"role": "assistant", "content": "re:Tell me more#1"}]
    assert records[2]["finish_reasons"] == ["stop"] * 3 and records[0]["source"] == "test"
    # Turn 2 of conversation "a" was generated from the target's own first answer, not the original one.
    second_turn_prompts = [c for call in backend.calls for c in call if c[-1]["content"] == "Tell me more"]
    assert second_turn_prompts[0][1] == {"role": "assistant", "content": "re:Hello there#0"}
    # Per-turn batching: batch 0 = (a, b): turn 1 for both, then turn 2 for "a" only.
    assert [len(call) for call in backend.calls[:2]] == [2, 1]

    limited = tmp_path / "limited.jsonl"
    regenerate_conversations([conv("s", "q1", "x", "q2", system="orig sys")], EchoBackend(), limited,
                             RegenerationSettings(max_new_tokens=8, max_turns=1, system_prompt="Configured.",
                                                  show_progress=False))
    assert read_records(limited)[0]["conversations"] == [
        {"role": "system", "content": "Configured."}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "re:q1#0"}]


def test_prompt_too_long_ends_conversation_at_last_answer(tiny_llama, tmp_path):
    tokenizer = tiny_llama.tokenizer
    limit = len(prompt_ids(tokenizer, CONVS[0].messages[:1])) + 3
    backend = LocalBackend(tiny_llama.model, tokenizer, max_prompt_tokens=limit)
    out = tmp_path / "o.jsonl"
    with always_token(tiny_llama.model, tokenizer.convert_tokens_to_ids("a")):  # an answer, not whitespace
        regenerate_conversations([CONVS[0], conv("long", "word " * 200)], backend, out,
                                 RegenerationSettings(max_new_tokens=2, show_progress=False))
    first, second = read_records(out)
    assert first["finish_reasons"] == ["length", "prompt_too_long"]
    assert [m["role"] for m in first["conversations"]] == ["user", "assistant"]
    assert second["finish_reasons"] == ["prompt_too_long"] and len(second["conversations"]) == 1


def test_an_empty_local_answer_ends_its_conversation_and_is_never_written(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama.model, tiny_llama.tokenizer
    out = tmp_path / "o.jsonl"
    with always_token(model, tokenizer.convert_tokens_to_ids("<|im_end|>")):  # every answer ends at once: ""
        report = regenerate_conversations([CONVS[0], CONVS[1]], LocalBackend(model, tokenizer), out,
                                          RegenerationSettings(max_new_tokens=3, show_progress=False))
    records = read_records(out)
    assert [r["conversations"] for r in records] == [CONVS[0].messages[:1], CONVS[1].messages[:1]]
    assert [r["finish_reasons"] for r in records] == [["empty_answer"], ["empty_answer"]]
    assert report.unanswered == {"empty_answer": 2} and report.num_turns_generated == 0


def test_prompts_longer_than_the_context_are_counted_named_and_the_fix_said(tiny_llama, tmp_path, caplog):
    backend = LocalBackend(tiny_llama.model, tiny_llama.tokenizer)
    assert backend.context_length == tiny_llama.model.config.max_position_embeddings
    convs = [Conversation(id=cid, messages=[{"role": "user", "content": text}], source="p.jsonl", line=line)
             for line, (cid, text) in enumerate([("short", "Hi"), ("long1", "word " * 30), ("long2", "word " * 40)],
                                                start=1)]
    context = len(prompt_ids(tiny_llama.tokenizer, convs[0].messages)) + 5
    backend.context_length = context  # a target with a short context (the tiny one's positions go further)
    with caplog.at_level("WARNING", logger="deepspec.data.regenerate"), \
            always_token(tiny_llama.model, tiny_llama.tokenizer.convert_tokens_to_ids("a")):  # answers, not whitespace
        report = regenerate_conversations(convs, backend, tmp_path / "o.jsonl",
                                          RegenerationSettings(max_new_tokens=2, show_progress=False))
    assert report.num_over_context == 2 and "2 with a prompt longer than the target's context" in report.summary()
    warning = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warning) == 1 and warning[0].startswith(
        f"2 conversations had a prompt longer than the target's context of {context} tokens: 'long1' (p.jsonl:2), "
        "'long2' (p.jsonl:3);")
    assert f"--max-prompt-tokens {context} (or less) stops each conversation" in warning[0]


def test_resume_after_kill_is_identical_with_sampling(tiny_llama, tmp_path):
    backend = LocalBackend(tiny_llama.model, tiny_llama.tokenizer)
    settings = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "batch_size": 2, "seed": 11,
                "show_progress": False}
    full = tmp_path / "full.jsonl"
    regenerate_conversations(CONVS, backend, full, RegenerationSettings(**settings))
    full_bytes = full.read_bytes()
    lines = full_bytes.splitlines(keepends=True)

    partial = tmp_path / "partial.jsonl"
    # Killed mid-batch (batch 1 = items 2, 3) while writing item 3: 3 complete lines + half a line.
    partial.write_bytes(b"".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    (tmp_path / "partial.jsonl.meta.json").write_bytes((tmp_path / "full.jsonl.meta.json").read_bytes())
    report = regenerate_conversations(CONVS, backend, partial, RegenerationSettings(**settings))
    assert partial.read_bytes() == full_bytes
    assert report.num_resumed == 3 and report.num_written == 2

    # Resuming a finished file generates and writes nothing.
    calls = []
    counting = LocalBackend(tiny_llama.model, tiny_llama.tokenizer)
    counting.generate = lambda *args, **kwargs: calls.append(args) or []
    again = regenerate_conversations(CONVS, counting, partial, RegenerationSettings(**settings))
    assert again.num_written == 0 and calls == [] and partial.read_bytes() == full_bytes


def test_a_full_disk_keeps_the_complete_records_and_the_rerun_finishes_the_same_file(tmp_path):
    from deepspec.utils.faults import full_disk
    from deepspec.utils.io import DiskFullError

    settings = {"max_new_tokens": 8, "batch_size": 2, "show_progress": False}
    full, out = tmp_path / "full.jsonl", tmp_path / "out.jsonl"
    regenerate_conversations(CONVS, EchoBackend(), full, RegenerationSettings(**settings))
    lines = full.read_bytes().splitlines(keepends=True)
    meta_bytes = (tmp_path / "full.jsonl.meta.json").stat().st_size
    with full_disk(tmp_path, free_bytes=meta_bytes + len(lines[0]) + len(lines[1]) + len(lines[2]) // 2):
        with pytest.raises(DiskFullError) as error:
            regenerate_conversations(CONVS, EchoBackend(), out, RegenerationSettings(**settings))
        message = str(error.value)
    assert message.startswith(f"{out}: no space left on device (it needs about {len(lines[2])} B, ")
    assert "the 2 complete records before it are kept (a rerun of the same command resumes after them)" in message
    assert out.read_bytes() == b"".join(lines[:2])
    report = regenerate_conversations(CONVS, EchoBackend(), out, RegenerationSettings(**settings))
    assert report.num_resumed == 2 and out.read_bytes() == full.read_bytes()


def test_a_second_regeneration_into_the_same_output_is_refused_naming_the_first(tmp_path):
    """Two runs into one --out at once: the second is refused before it reads or writes anything, naming the first;
    the first finishes alone (one record per id, none twice) and leaves no lock file behind."""
    import threading

    from deepspec.utils.locks import LockHeldError

    settings = {"max_new_tokens": 8, "batch_size": 2, "show_progress": False}
    out, written, release, finished = tmp_path / "out.jsonl", threading.Event(), threading.Event(), []

    class SlowBackend(EchoBackend):
        def generate(self, conversations, sampling, max_new_tokens, seed):
            if out.exists() and out.read_text():  # a first batch is on disk: the second run starts now
                written.set()
                release.wait(120)
            return super().generate(conversations, sampling, max_new_tokens, seed)

    first = threading.Thread(target=lambda: finished.append(
        regenerate_conversations(CONVS, SlowBackend(), out, RegenerationSettings(**settings))))
    first.start()
    try:
        assert written.wait(120)
        before = out.read_bytes()
        with pytest.raises(LockHeldError, match=rf"^{tmp_path / '.out.jsonl.lock'}: the regeneration into {out} "
                                                rf"is being written by another run: pid {os.getpid()} "):
            regenerate_conversations(CONVS, EchoBackend(), out, RegenerationSettings(**settings))
        assert out.read_bytes() == before
    finally:
        release.set()
        first.join(120)
    assert [r["id"] for r in read_records(out)] == [c.id for c in CONVS] and finished[0].num_written == len(CONVS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.meta.json"]


def test_mismatched_existing_output_is_a_clear_error(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps({"id": "a", "conversations": []}) + "\n" + json.dumps({"id": "zzz"}) + "\n")
    with pytest.raises(ValueError, match=r"o.jsonl:2: id 'zzz' but input position 1 has id 'b'"):
        regenerate_conversations(CONVS, EchoBackend(), out, RegenerationSettings(max_new_tokens=4, show_progress=False))
    out.write_text("not json\n")
    with pytest.raises(ValueError, match="o.jsonl:1: not a regenerated record"):
        read_existing_output(out, ["a"])
    out.write_bytes(b"\xff\xfe\n")
    with pytest.raises(ValueError, match="o.jsonl:1: not valid UTF-8"):
        read_existing_output(out, ["a"])
    out.write_text("".join(json.dumps({"id": c.id}) + "\n" for c in CONVS))
    with pytest.raises(ValueError, match="has 5 lines but the input has only 2"):
        read_existing_output(out, ["a", "b"])


def write_prompts(path, convs):
    path.write_text("".join(json.dumps({"id": c.id, "conversations": c.messages}) + "\n" for c in convs))
    return path


def test_unrelated_output_is_refused_untouched(tmp_path):
    """An existing file that is not this input's regeneration keeps every byte, last record included
    (it used to be cut as a 'truncated last line' before the id check refused)."""
    unrelated = tmp_path / "unrelated.jsonl"
    unrelated.write_bytes(b'{"id": "x1", "text": "keep me"}\n{"id": "x2", "text": "and me"}')  # no final newline
    before = unrelated.read_bytes()
    with pytest.raises(ValueError, match=r"unrelated.jsonl:1: id 'x1' but input position 0 has id 'a'"):
        regenerate_conversations(CONVS, EchoBackend(), unrelated,
                                 RegenerationSettings(max_new_tokens=4, show_progress=False))
    assert unrelated.read_bytes() == before and not (tmp_path / "unrelated.jsonl.meta.json").exists()

    # Only a line without a line end, not the start of the first expected record: left as it is.
    unrelated.write_bytes(b'{"notes": "a file without a newline"}')
    with pytest.raises(ValueError, match=r"unrelated.jsonl:1: the last line has no line end and is not the start"):
        regenerate_conversations(CONVS, EchoBackend(), unrelated,
                                 RegenerationSettings(max_new_tokens=4, show_progress=False))
    assert unrelated.read_bytes() == b'{"notes": "a file without a newline"}'

    # Records with the input's own ids but no meta file (e.g. a copy of the prompt file): not regenerated.
    copy = write_prompts(tmp_path / "copy.jsonl", CONVS[:2])
    before = copy.read_bytes()
    with pytest.raises(ValueError, match=r"copy.jsonl exists and is not empty, but copy.jsonl.meta.json .* is missing"):
        regenerate_conversations(CONVS, EchoBackend(), copy,
                                 RegenerationSettings(max_new_tokens=4, show_progress=False))
    assert copy.read_bytes() == before and not (tmp_path / "copy.jsonl.meta.json").exists()


def test_output_that_is_an_input_is_refused(tmp_path):
    from deepspec.data.sources import load_jsonl

    prompts = write_prompts(tmp_path / "prompts.jsonl", CONVS)
    before = prompts.read_bytes()
    convs, _ = load_jsonl(prompts)
    link = tmp_path / "link.jsonl"
    link.symlink_to(prompts)
    for out in (prompts, link, tmp_path / "sub" / ".." / "prompts.jsonl"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(ValueError, match=r"is the input file .*prompts.jsonl .*never writes into its input"):
            regenerate_conversations(convs, EchoBackend(), out,
                                     RegenerationSettings(max_new_tokens=4, show_progress=False), input_paths=[prompts])
        assert prompts.read_bytes() == before
    assert not list(tmp_path.glob("*.meta.json"))


def test_cli_refuses_out_equal_to_prompts(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", CONVS[:2])
    before = prompts.read_bytes()
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(repo / "data_tools" / "regenerate.py"), "--prompts", str(prompts),
                           "--out", str(prompts), "--target", "tiny-random-llama", "--max-new-tokens", "2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "never writes into its input" in proc.stderr
    assert prompts.read_bytes() == before and not (tmp_path / "prompts.jsonl.meta.json").exists()


def test_resume_counts_records_whose_text_holds_unicode_line_separators(tmp_path):
    """JSON lines are separated by \\n only: U+2028/U+0085 inside an answer (written raw with
    ensure_ascii=False) must not split a record when resuming."""
    out = tmp_path / "o.jsonl"
    convs = [conv("p", "first\u2028line\x85next"), conv("q", "plain")]
    regenerate_conversations(convs, EchoBackend(), out,
                             RegenerationSettings(max_new_tokens=4, batch_size=1, show_progress=False))
    assert "\u2028" in out.read_text(encoding="utf-8")
    assert read_existing_output(out, ["p", "q"]).num_done == 2
    first = out.read_bytes().split(b"\n")[0] + b"\n"
    out.write_bytes(first)
    backend = EchoBackend()
    regenerate_conversations(convs, backend, out,
                             RegenerationSettings(max_new_tokens=4, batch_size=1, show_progress=False))
    assert len(backend.calls) == 1 and [r["id"] for r in read_records(out)] == ["p", "q"]


def test_resume_with_changed_settings_is_refused(tmp_path):
    out = tmp_path / "o.jsonl"
    regenerate_conversations(CONVS[:3], EchoBackend(), out,
                             RegenerationSettings(max_new_tokens=4, batch_size=1, show_progress=False))
    out.write_text(out.read_text().splitlines(keepends=True)[0])
    with pytest.raises(ValueError, match="max_new_tokens.*4.*8|generation was"):
        regenerate_conversations(CONVS[:3], EchoBackend(), out,
                                 RegenerationSettings(max_new_tokens=8, batch_size=1, show_progress=False))
    with pytest.raises(ValueError, match="temperature=-1"):
        regenerate_conversations(CONVS, EchoBackend(), tmp_path / "x.jsonl",
                                 RegenerationSettings(max_new_tokens=4, temperature=-1))


@pytest.mark.slow
def test_real_target_answers_and_stops_at_im_end(smollm2, tmp_path):
    from deepspec.data.chat import render_conversation

    backend = LocalBackend(smollm2.model, smollm2.tokenizer)
    question = conv("q", "What is 2+2? Answer with one number.")
    out = tmp_path / "real.jsonl"
    regenerate_conversations([question, conv("h", "Say hello.")], backend, out,
                             RegenerationSettings(max_new_tokens=24, batch_size=2, show_progress=False))
    first, second = read_records(out)
    assert first["conversations"][1] == {"role": "assistant", "content": "The answer is 4."}
    assert first["finish_reasons"] == ["stop"] and second["finish_reasons"] == ["length"]
    alone = backend.generate([question.messages], GREEDY, 24, seed=0)[0]
    assert (alone.text, alone.num_tokens) == ("The answer is 4.", 7)  # left padding in the batch changed nothing
    sample = render_conversation(smollm2.tokenizer, first["conversations"])
    masked = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert smollm2.tokenizer.decode(masked, skip_special_tokens=False) == "The answer is 4.<|im_end|>"


def test_recommended_sampling_by_field_command_line_then_target_config_then_generation_config():
    from transformers import GenerationConfig

    from deepspec.targets.config import target_settings
    from deepspec.targets.load import resolve_target

    assert recommended_sampling() == ({"temperature": 0.7, "top_p": 1.0, "top_k": 0},
                                      dict.fromkeys(("temperature", "top_p", "top_k"), "reference default"))
    qwen3 = target_settings("qwen3-4b").sampling  # non-thinking mode's recommendation, in conf/target/qwen3-4b.yaml
    llama_like = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9)
    values, sources = recommended_sampling(qwen3, llama_like)
    assert values == {"temperature": 0.7, "top_p": 0.8, "top_k": 20} and set(sources.values()) == {"target config"}
    values, sources = recommended_sampling(target_settings("llama3.1-8b").sampling, llama_like, {"top_k": 5})
    assert values == {"temperature": 0.6, "top_p": 0.9, "top_k": 5}
    assert sources == {"temperature": "generation_config", "top_p": "generation_config", "top_k": "command line"}
    # SmolLM2 recommends nothing (its generation_config.json sets no sampling field): the reference's T = 0.7.
    smollm2_path, kwargs, _ = resolve_target("smollm2-135m")
    values, sources = recommended_sampling(target_settings("smollm2-135m").sampling,
                                           GenerationConfig.from_pretrained(smollm2_path, **kwargs))
    assert values["temperature"] == 0.7 and sources["temperature"] == "reference default"


def test_cli_samples_with_the_recommended_parameters_by_default_and_resume_refuses_a_change(tmp_path):
    """The output's meta records the sampling values (and their source) and the template options; a resume with
    --greedy or other template options is refused naming the setting."""
    from deepspec.data.cli import main

    prompts = write_prompts(tmp_path / "prompts.jsonl", CONVS[:2])
    out = tmp_path / "out.jsonl"
    base = ["--prompts", str(prompts), "--out", str(out), "--target", "tiny-random-llama", "--max-new-tokens", "2",
            "--max-turns", "1"]
    assert main(base) == 0
    meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    assert meta["generation"] == {"max_new_tokens": 2, "temperature": 0.7, "top_p": 1.0, "top_k": 0}
    assert set(meta["generation_source"].values()) == {"reference default"} and meta["chat_template_kwargs"] == {}
    with pytest.raises(ValueError, match="generation was .*'temperature': 0.7.*now .*'temperature': 0.0"):
        main([*base, "--greedy"])
    with pytest.raises(ValueError, match=r"chat_template_kwargs was \{\}, now \{'enable_thinking': False\}"):
        main([*base, "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert main([*base, "--temperature", "0.7"]) == 0  # same value, other source: resumes (nothing left to do)
    with pytest.raises(SystemExit):
        main([*base, "--greedy", "--temperature", "0.5"])


def test_the_meta_records_the_weights_dtype_and_a_resume_in_another_is_refused(tiny_llama, tmp_path):
    """bf16 and fp32 weights give different greedy answers: one output file holds answers of one dtype."""
    import copy

    fp32 = LocalBackend(tiny_llama.model, tiny_llama.tokenizer)
    bf16 = LocalBackend(copy.deepcopy(tiny_llama.model).to(torch.bfloat16), tiny_llama.tokenizer)
    out = tmp_path / "out.jsonl"
    settings = dict(max_new_tokens=2, batch_size=1, max_turns=1, show_progress=False)
    regenerate_conversations(CONVS[:2], bf16, out, RegenerationSettings(**settings))
    assert json.loads((tmp_path / "out.jsonl.meta.json").read_text())["backend"]["dtype"] == "bfloat16"
    out.write_text(out.read_text().splitlines(keepends=True)[0])  # killed after the first record
    with pytest.raises(ValueError, match="backend was .*'dtype': 'bfloat16'.*now .*'dtype': 'float32'"):
        regenerate_conversations(CONVS[:2], fp32, out, RegenerationSettings(**settings))
    assert regenerate_conversations(CONVS[:2], bf16, out, RegenerationSettings(**settings)).num_written == 1


FIELDS = {"format": "data.format", "chat_template": "target.chat_template",
          "chat_template_kwargs": "target.chat_template_kwargs"}


def test_regenerated_data_must_match_the_template_options_of_the_next_stage(tmp_path):
    from deepspec.data.regenerate import check_regenerated_rendering

    out = tmp_path / "o.jsonl"
    non_thinking = Rendering(chat_template_kwargs={"enable_thinking": False})
    regenerate_conversations(CONVS[:1], EchoBackend(non_thinking), out,
                             RegenerationSettings(max_new_tokens=4, show_progress=False))
    check_regenerated_rendering(out, non_thinking, FIELDS)
    with pytest.raises(ValueError, match=r"target.chat_template_kwargs=\{\} but the regenerated data .*o.jsonl "
                                         r"\(o.jsonl.meta.json\) was rendered with chat_template_kwargs="):
        check_regenerated_rendering(out, Rendering(), FIELDS)
    with pytest.raises(ValueError, match=r"data.format=text but the regenerated data .*o.jsonl .*was rendered in the "
                                         r"chat format: set data.format=chat"):
        check_regenerated_rendering(out, Rendering(format="text"), FIELDS)
    check_regenerated_rendering("sharegpt", Rendering(), FIELDS)  # no regeneration meta: nothing to check
