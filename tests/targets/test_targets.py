import pytest
import torch

from deepspec.targets.family import get_family
from deepspec.targets.features import capture_features
from deepspec.targets.layers import spread_layer_ids, to_input_of_layer, validate_layer_ids
from deepspec.targets.load import load_target, resolve_target


def test_default_layers_match_design():
    assert spread_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert spread_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert to_input_of_layer([1, 9]) == [2, 10]


def test_out_of_range_layer_fails_before_compute():
    with pytest.raises(ValueError, match=r"target_layer_ids\[1\]=29 is out of range.*valid 0..28"):
        validate_layer_ids([1, 29], num_layers=30)
    with pytest.raises(ValueError, match="duplicates"):
        validate_layer_ids([3, 3], num_layers=30)


def test_unknown_names_and_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an embedded target"):
        resolve_target("no-such-model")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        resolve_target(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_target(str(tmp_path))
    with pytest.raises(ValueError, match="not supported"):
        get_family("gpt2")


@pytest.mark.float_exact
def test_captured_features_equal_hidden_states(tiny_target):
    target = tiny_target
    ids = torch.randint(0, 1000, (2, 9))
    mask = torch.ones_like(ids)
    feats = capture_features(target.model, ids, mask, [0, 2])
    ref = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[1], ref.hidden_states[3]], dim=-1)
    assert torch.equal(feats.features_BTF, expected)
    assert torch.equal(feats.final_hidden_BTH, ref.hidden_states[-1])
    # The LM head on the final hidden state reproduces the target logits.
    logits = feats.final_hidden_BTH @ target.model.get_output_embeddings().weight.T
    torch.testing.assert_close(logits, ref.logits)


@pytest.mark.slow
def test_embedded_target_loads_from_converted_cache():
    target = load_target("smollm2-135m", dtype="float32", device="cpu")
    assert target.num_layers == 30 and target.config.hidden_size == 576 and target.config.vocab_size == 49152
    assert target.model.dtype == torch.float32
    assert not any(p.requires_grad for p in target.model.parameters())
    fp = target.fingerprint()
    assert fp["revision"].startswith("gguf:") and len(fp["tokenizer_hash"]) == 16


def test_cache_keyword_follows_the_installed_transformers(tiny_target):
    """transformers 5.17 (and earlier 5.x) takes `past_key_values=`, newer 5.x `cache=`; the other name is
    swallowed by **kwargs and silently disables the KV cache, so the keyword is read from the signature."""
    from transformers import DynamicCache

    from deepspec.targets.family import cache_kwargs
    from deepspec.targets.features import decoder_stack

    class OldStyle(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=False, **kwargs):
            return past_key_values

    class NewStyle(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=False, **kwargs):
            return cache

    assert cache_kwargs(OldStyle(), "c") == {"past_key_values": "c"}
    assert cache_kwargs(NewStyle(), "c") == {"cache": "c"}
    stack = decoder_stack(tiny_target.model)
    cache = DynamicCache(config=tiny_target.model.config)
    with torch.no_grad():
        stack(input_ids=torch.tensor([[1, 2, 3]]), **cache_kwargs(stack, cache), use_cache=True)
    assert cache.get_seq_length() == 3  # the cache was really used


def test_log_normalizer_is_the_full_vocabulary_logsumexp(tiny_target):
    from deepspec.targets.features import capture_features, log_normalizer, target_log_normalizer

    model = tiny_target.model
    ids = torch.tensor([[1, 5, 77, 912, 33, 4001, 17]])
    final_TH = capture_features(model, ids, None, [0]).final_hidden_BTH[0]
    logits_TV = model(ids).logits[0]  # the target's own forward, its own head (and soft-cap, if any)
    torch.testing.assert_close(target_log_normalizer(model, final_TH), torch.logsumexp(logits_TV.float(), -1),
                               rtol=1e-6, atol=1e-5)
    head_VH = model.get_output_embeddings().weight
    chunked = log_normalizer(final_TH, head_VH, softcap=2.0, chunk_rows=3)
    expected = torch.logsumexp(torch.tanh((final_TH @ head_VH.T) / 2.0) * 2.0, dim=-1)
    torch.testing.assert_close(chunked, expected)
    # A hidden state stored in bf16 is multiplied in fp32 against the fp32 head (never rounded further).
    stored = final_TH.to(torch.bfloat16)
    assert log_normalizer(stored, head_VH).dtype == torch.float32
    torch.testing.assert_close(log_normalizer(stored, head_VH), torch.logsumexp(stored.float() @ head_VH.T, -1))
