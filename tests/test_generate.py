"""HF `generate` with a static cache, compiled the way transformers documents it
(`compile_config=CompileConfig(backend=graphopt.backend(...))`), and the backend object itself.

CPU: a tiny LlamaForCausalLM (random weights, fp32). With the default passes the greedy tokens equal
eager's; with each pass forced on, generate runs and the rewrites were applied. GPU (skipped
without one): the same under mode="reduce-overhead" (CUDA graphs) with the 4-bit passes, whose
tokens must equal those of the same passes without CUDA graphs."""

import copy
import inspect

import pytest
import torch

import graphopt
from graphopt.compiler import recording_decisions

transformers = pytest.importorskip("transformers")

PROMPT, NEW_TOKENS = 12, 6


def _tiny_llama(device: str = "cpu", dtype: torch.dtype = torch.float32, attn: str = "eager"):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64)
    config._attn_implementation = attn
    return transformers.LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)


def _generate(model, ids, compile_config=None):
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                  cache_implementation="static", pad_token_id=0)
    if compile_config is None:
        kwargs["disable_compile"] = True
    else:
        kwargs["compile_config"] = compile_config
    with torch.no_grad():
        return model.generate(ids, **kwargs)[:, ids.shape[1]:]


def _compile_config(backend, mode="reduce-overhead"):
    config = transformers.CompileConfig(backend=backend, mode=mode)
    config._compile_all_devices = True  # transformers compiles generate's decode step on CUDA only, unless told
    return config


def test_backend_carries_options_survives_deepcopy_and_compares_by_options():
    backend = graphopt.backend(passes={"fp4_linear": True}, force=True)
    clone = copy.deepcopy(backend)
    assert clone == backend and hash(clone) == hash(backend) and clone is not backend
    assert clone.options == {"passes": {"fp4_linear": True}, "force": True}
    assert graphopt.backend(passes={"q4_linear": True}) != backend
    # equal options in another key order, at any depth, hash alike (sets and dict keys of backends)
    first = graphopt.backend(passes={"fp4_linear": True, "attention": False}, error_budget={"fp4_linear": 40.0})
    second = graphopt.backend(error_budget={"fp4_linear": 40.0}, passes={"attention": False, "fp4_linear": True})
    assert first == second and hash(first) == hash(second) and len({first, second}) == 1
    # transformers compiles again only when the config differs: equal backends keep one compile
    assert _compile_config(backend) == _compile_config(clone)


def test_backend_rejects_bad_options_where_it_is_built():
    with pytest.raises(ValueError, match="fp4_linnear.*did you mean 'fp4_linear'"):
        graphopt.backend(passes={"fp4_linnear": True})
    with pytest.raises(ValueError, match="unknown graphopt option 'cuda_graph'"):
        graphopt.backend(cuda_graph=True)


def test_mode_reduce_overhead_means_cuda_graphs_and_bad_modes_are_named():
    from graphopt.compiler import config_for

    assert config_for({}, "reduce-overhead").cuda_graphs
    assert not config_for({}, "default").cuda_graphs and not config_for({}, None).cuda_graphs
    assert not config_for({"downstream": "eager"}, "reduce-overhead").cuda_graphs  # only Inductor records graphs
    with pytest.raises(ValueError, match="mode 'fast' is not valid; valid choices: default, reduce-overhead"):
        config_for({}, "fast")


def test_torch_compile_accepts_mode_with_a_backend_carrying_options():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).eval()
    x = torch.randn(3, 64)
    compiled = torch.compile(model, backend=graphopt.backend(passes={"fp4_linear": True}, force=True),
                             mode="reduce-overhead")
    with torch.no_grad(), recording_decisions(reset=True) as decisions:
        got = compiled(x)
    assert sum(d.applied for d in decisions if d.pass_name == "fp4_linear") == 2
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), atol=0.3, rtol=0.1)  # FP4 weights: close, not equal


def test_generate_default_passes_give_eager_tokens():
    model = _tiny_llama()
    ids = torch.randint(1, 256, (2, PROMPT))
    eager = _generate(model, ids)
    with recording_decisions(reset=True) as decisions:
        compiled = _generate(model, ids, _compile_config(graphopt.backend()))
    assert torch.equal(compiled, eager)
    assert any(d.pass_name == "attention" and d.applied for d in decisions), [d.reason for d in decisions]


def test_one_static_cache_reset_and_passed_to_every_call_gives_eager_tokens_and_compiles_once():
    """The README's recipe for calling generate more than once: one StaticCache, reset before each
    call (so a CUDA-graph tree keeps its recording; transformers makes a new cache per call otherwise)."""
    model = _tiny_llama()
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS)
    config = _compile_config(graphopt.backend())
    compiled_after = []
    with recording_decisions(reset=True) as decisions:
        for _ in range(2):
            ids = torch.randint(1, 256, (1, PROMPT))
            eager = _generate(model, ids)
            cache.reset()
            with torch.no_grad():
                tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                        pad_token_id=0, compile_config=config, **{cache_arg: cache})[:, PROMPT:]
            assert torch.equal(tokens, eager)
            compiled_after.append(len(decisions))
    assert compiled_after[0] > 0 and compiled_after[1] == compiled_after[0]  # the second call compiles nothing


@pytest.mark.parametrize("pass_name", ["attention", "sparse_attention", "fp4_linear", "q4_linear"])
def test_generate_runs_with_each_pass_forced(pass_name):
    model = _tiny_llama()
    ids = torch.randint(1, 256, (1, PROMPT))
    backend = graphopt.backend(passes={pass_name: True}, force=True)
    with recording_decisions(reset=True) as decisions:
        tokens = _generate(model, ids, _compile_config(backend))
    assert tokens.shape == (1, NEW_TOKENS)
    ours = [d for d in decisions if d.pass_name == pass_name]
    if pass_name == "sparse_attention":
        # one-token decode queries: the pass runs them dense or declines, with a reason
        assert ours and all(d.reason for d in ours)
    else:
        assert any(d.applied for d in ours), [d.reason for d in ours]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("error:graphopt. the downstream compiler failed:RuntimeWarning")  # no silent fallback
@pytest.mark.parametrize("pass_name", ["fp4_linear", "q4_linear"])
def test_generate_under_cuda_graphs_with_4bit_passes_equals_the_same_passes_without(pass_name):
    model = _tiny_llama("cuda", torch.bfloat16, attn="sdpa")
    ids = torch.randint(1, 256, (1, PROMPT), device="cuda")
    backend = graphopt.backend(passes={pass_name: True}, force=True)
    torch._dynamo.reset()
    direct = _generate(model, ids, _compile_config(backend, mode="default"))
    torch._dynamo.reset()
    with recording_decisions() as decisions:
        graphed = _generate(model, ids, _compile_config(backend))
        again = _generate(model, ids, _compile_config(backend))
    torch._dynamo.reset()
    assert any(d.applied for d in decisions if d.pass_name == pass_name)
    assert torch.equal(graphed, direct) and torch.equal(again, direct)
