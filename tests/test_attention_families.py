"""The attention pass on the `transformers` families whose attention is written other than
LLaMA's (tiny random configs, eager attention, CPU, fp32): BLOOM (ALiBi through baddbmm on
(B*H, L, D) tensors), Falcon (multi-query, ALiBi, grouped heads, and its SDPA calls without
enable_gqa), SigLIP (its encoder, and its pooling head's nn.MultiheadAttention), and Gemma 2
(soft-capped scores, which only graphopt's Triton kernel takes: compiled for an H100 target, whose
op runs its torch reference on the CPU), and DeBERTa-v2 (disentangled attention: its
content-to-position and position-to-content terms, added to (B*H, L, L) scores viewed as (B, H, L, L),
become the bias). Every attention is rewritten, outputs are within 2e-4 of eager, and gradients
match."""

from __future__ import annotations

import copy

import pytest
import torch

import graphopt
from graphopt import compiler as backend_module
from tests.conftest import tf32_allowed

transformers = pytest.importorskip("transformers")
T = transformers

SEQ = 12


class Output(torch.nn.Module):
    """Model -> one tensor (logits, or a vision model's pooled output), with fixed keyword inputs."""

    def __init__(self, model, **kwargs):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, x):
        out = self.model(x, **self.kwargs)
        if hasattr(out, "logits"):
            return out.logits
        return out.pooler_output if getattr(out, "pooler_output", None) is not None else out.last_hidden_state


def _padding():
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :3] = 0  # left padding in the second sequence
    return mask


def build(family: str, **variant):
    """(model, its input, the number of attention layers)."""
    torch.manual_seed(0)
    ids = torch.randint(1, 97, (2, SEQ), generator=torch.Generator().manual_seed(1))
    implementation = variant.pop("attn_implementation", "eager")
    padded = variant.pop("padded", False)
    kwargs = dict(use_cache=False, attention_mask=_padding()) if padded else dict(use_cache=False)
    if family == "bloom":
        config = T.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=97, **variant)
    elif family == "falcon":
        config = T.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=97, **variant)
    elif family == "gemma2":
        config = T.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0, sliding_window=8,
                                vocab_size=97, **variant)
    elif family == "deberta":
        config = T.DebertaV2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   vocab_size=97, relative_attention=True, pos_att_type=["c2p", "p2c"],
                                   max_relative_positions=16, position_buckets=8, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)
        model = T.AutoModel.from_config(config, attn_implementation=implementation)
        padded = dict(attention_mask=_padding()) if padded else {}
        return Output(model, **padded), ids, config.num_hidden_layers
    elif family == "siglip":
        config = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      image_size=32, patch_size=8)
        model = T.SiglipVisionModel(config)
        model.config._attn_implementation = implementation
        pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        return Output(model), pixels, 3  # two encoder layers and the pooling head
    else:
        raise KeyError(family)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    return Output(model, **kwargs), ids, config.num_hidden_layers


FAMILIES = {
    "bloom": ("bloom", {}),
    "bloom_padded": ("bloom", {"padded": True}),
    "falcon_multi_query": ("falcon", {"multi_query": True}),
    "falcon_multi_query_padded": ("falcon", {"multi_query": True, "padded": True}),
    "falcon_alibi": ("falcon", {"alibi": True, "multi_query": True}),
    "falcon_grouped_heads": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "falcon_sdpa_multi_query": ("falcon", {"multi_query": True, "attn_implementation": "sdpa"}),
    "siglip_with_pooling_head": ("siglip", {}),
    "gemma2_soft_capped": ("gemma2", {}),
    "deberta_v2_disentangled": ("deberta", {"padded": True}),
}
# where the family's attention needs graphopt's Triton kernel (fp32 through TF32, allowed here)
TARGETS = {"gemma2_soft_capped": dict(target="h100", graph_replay=True)}


@pytest.fixture(autouse=True)
def _tf32():
    with tf32_allowed():
        yield


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_attention_is_rewritten_and_logits_match(name):
    family, variant = FAMILIES[name]
    model, x, n_attention = build(family, **dict(variant))
    model.eval()
    report = graphopt.explain(model, x, downstream="eager", **TARGETS.get(name, {}))
    attention = [d for d in report.decisions if d.pass_name == "attention"]
    assert report.counts["attention"] == n_attention == len(attention), str(report)
    if family == "gemma2":
        assert all(d.implementation == "triton" and d.details["softcap"] == 50.0 for d in attention)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(report.output, expected, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", ["bloom_padded", "falcon_alibi", "falcon_grouped_heads", "siglip_with_pooling_head",
                                  "gemma2_soft_capped", "deberta_v2_disentangled"])
def test_gradients_match_eager(name):
    family, variant = FAMILIES[name]
    model, x, n_attention = build(family, **dict(variant))
    model.train()  # attention dropout p=0 in these configs: the pass still applies
    eager, trained = copy.deepcopy(model), copy.deepcopy(model)
    with backend_module.recording_decisions(reset=True) as decisions:
        out = torch.compile(trained, backend="graphopt", options={"downstream": "eager", **TARGETS.get(name, {})})(x)
    assert sum(d.applied for d in decisions if d.pass_name == "attention") == n_attention
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    if variant.get("padded"):
        # the loss skips padding positions, as usual: rows whose keys are all masked have another
        # gradient rewritten than eager (see the attention pass's docstring)
        weights[_padding() == 0] = 0
    (out * weights).sum().backward()
    expected = eager(x)
    (expected * weights).sum().backward()
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=0)
    for (param, p), (_, q) in zip(eager.named_parameters(), trained.named_parameters()):
        if p.grad is None:
            assert q.grad is None, param
            continue
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{param}: {m}")
