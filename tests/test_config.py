import json

import pytest

from graphopt.config import DEFAULT_PASSES, PASS_NAMES, GraphOptConfig


def test_defaults_enable_only_lossless_passes():
    config = GraphOptConfig.from_options(None, environ={})
    assert config.passes == DEFAULT_PASSES
    assert config.enabled("attention") and not config.enabled("fp4_linear")


def test_unknown_option_names_valid_keys():
    with pytest.raises(ValueError, match=r"unknown graphopt option 'pases'.*did you mean 'passes'.*valid choices"):
        GraphOptConfig.from_options({"pases": {}}, environ={})


def test_misspelt_pass_name_lists_valid_passes():
    with pytest.raises(ValueError) as info:
        GraphOptConfig.from_options({"passes": {"atention": True}}, environ={})
    message = str(info.value)
    assert "'atention'" in message and "did you mean 'attention'" in message
    for name in PASS_NAMES:
        assert name in message


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"target": "h300"}, "target='h300'"),
        ({"downstream": "xla"}, "downstream='xla'"),
        ({"fp4_format": "nf4"}, "fp4_format='nf4'"),
        ({"passes": {"attention": "yes"}}, "must be True or False"),
        ({"error_budget": {"fp4_linear": -1}}, "non-negative"),
        ({"error_budget": {"fp4_linear": float("nan")}}, "finite non-negative"),  # NaN would pass every check
        ({"error_budget": {"sparse_attention": float("inf")}}, "finite non-negative"),
        ({"error_budget": {"attention": 0.1}}, "the attention pass is lossless and takes no budget"),
        ({"error_budget": {"atention": 0.1}}, "unknown pass 'atention' in error_budget"),
        ({"force": 1}, "force must be True or False"),
        ({"fuse_sibling_linears": "yes"}, "fuse_sibling_linears must be True or False"),
        ({"fuse_decode_neighbours": ["gelu"]},
         "fuse_decode_neighbours must be True, False or a list of rms_norm, silu_gate, residual, got ['gelu']"),
        ({"fuse_decode_neighbours": "yes"}, "fuse_decode_neighbours must be True, False or a list of"),
        ({"cuda_graphs": "on"}, "cuda_graphs must be True or False"),
        ({"cuda_graphs": True, "downstream": "eager"}, "needs downstream='inductor'"),
    ],
)
def test_bad_values_are_rejected_with_the_valid_choices(options, fragment):
    with pytest.raises(ValueError, match="valid choices|must be|non-negative|needs") as info:
        GraphOptConfig.from_options(options, environ={})
    assert fragment in str(info.value)


@pytest.mark.parametrize("content, fragment", [
    (None, "does not exist"),
    ("{not json", "is not valid JSON"),
    ('{"sparse_attention": {}}', 'lacks "graphopt_plan"'),
    ('[1, 2]', 'lacks "graphopt_plan"'),
    ('{"graphopt_plan": 1, "fft_linear": 5}', "section 'fft_linear' must be a JSON object"),
    ('{"graphopt_plan": 1, "sparse_attention": {"l1": null, "layers": {}}}', "'l1' must be a non-negative number"),
    ('{"graphopt_plan": 1, "fft_linear": {"file": "gone.safetensors", "layers": {"fc": {"in_features": 64, '
     '"out_features": 64, "block_size": 16, "k": 2, "rel_error": 0.01}}}}',
     "tensor file 'gone.safetensors' is not beside the plan"),
    ("directory", "cannot be read"),
])
def test_bad_plan_is_an_error_when_the_options_are_read(tmp_path, content, fragment):
    """Not a pass that fails at compile time and is skipped with a warning (the run would go on
    without the plan)."""
    path = tmp_path / "plan.json"
    if content == "directory":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match="graphopt plan") as info:
        GraphOptConfig.from_options({"plan": str(path)}, environ={})
    assert fragment in str(info.value)


def _sparse_layer(**changes):
    layer = {"heads": 2, "simthreshd1": [0.6, -1.0], "cdfthreshd": [0.95, 1.0], "pvthreshd": [None, 4.0],
             "sparsity": [0.4, 0.0], "dense": [False, True]}
    return {k: v for k, v in {**layer, **changes}.items() if v != "drop"}


@pytest.mark.parametrize("section, fragment", [
    ({"sparse_attention": {"layers": []}}, "\"layers\" must be an object"),
    ({"sparse_attention": {"layers": {"m.attn": 3}}}, "layer 'm.attn' must be a JSON object"),
    ({"sparse_attention": {"layers": {"m.attn": _sparse_layer(heads=0)}}}, "\"heads\" must be a positive integer"),
    ({"sparse_attention": {"layers": {"m.attn": _sparse_layer(cdfthreshd=[0.9])}}},
     "'cdfthreshd' must be a list of numbers in (0, 1], one per head (2 heads), got [0.9]"),
    ({"sparse_attention": {"layers": {"m.attn": _sparse_layer(cdfthreshd=[0.9, 1.5])}}}, "'cdfthreshd' must be"),
    ({"sparse_attention": {"layers": {"m.attn": _sparse_layer(simthreshd1="drop")}}}, "'simthreshd1' must be"),
    ({"sparse_attention": {"layers": {"m.attn": _sparse_layer(pvthreshd=[None, -1])}}}, "'pvthreshd' must be"),
    ({"sparse_attention": {"layers": {"m.attn": _sparse_layer(dense=[0, 1])}}}, "'dense' must be a list of booleans"),
    ({"fp4_linear": {"file": "w.safetensors", "layers": {"fc": {"format": "int4", "out_features": 8, "in_features": 32}}}},
     "\"format\" must be one of mxfp4, nvfp4, got 'int4'"),
    ({"fp4_linear": {"layers": {"fc": {"format": "nvfp4", "out_features": 8, "in_features": 32}}}},
     "\"file\" must name the tensor file"),
    ({"fft_linear": {"file": "c.safetensors", "layers": {"fc": {"in_features": 64, "out_features": 64, "block_size": 16,
                                                               "k": "4", "rel_error": 0.01}}}},
     "layer 'fc': 'k' must be a positive integer, got '4'"),
    ({"fft_linear": {"file": "c.safetensors", "layers": {"fc": {"in_features": 64, "out_features": 64, "block_size": 16,
                                                               "k": 4, "rel_error": float("nan")}}}},
     "'rel_error' must be a finite number >= 0"),  # NaN passed every budget check, then the model output NaN
    ({"fft_linear": {"file": "c.safetensors", "layers": {"fc": {"in_features": 64, "out_features": 64, "block_size": 16,
                                                               "k": 4, "rel_error": -0.5}}}},
     "'rel_error' must be a finite number >= 0"),
])
def test_malformed_plan_sections_are_errors_naming_the_field(tmp_path, section, fragment):
    """A section its pass would trip over (a missing or wrong-typed field) is an error when the
    options are read, not a pass that fails inside torch.compile and is skipped."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"graphopt_plan": 1, **section}))
    with pytest.raises(ValueError, match="graphopt plan") as info:
        GraphOptConfig.from_options({"plan": str(path)}, environ={})
    assert fragment in str(info.value)


def test_well_formed_plan_sections_pass_the_check(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"graphopt_plan": 1, "sparse_attention": {"l1": 0.06, "layers": {
        "m.attn": _sparse_layer(), "m.attn2": _sparse_layer(dense="drop")}},
        "fp4_linear": {"file": "w.safetensors", "layers": {"fc": {"format": "nvfp4", "out_features": 8, "in_features": 32}}},
        "fft_linear": {"file": "c.safetensors", "layers": {"fc": {"in_features": 64, "out_features": 64, "block_size": 16,
                                                                 "k": 4, "rel_error": 0.01, "note": "extra fields pass"}}}}))
    for name in ("w.safetensors", "c.safetensors"):  # the tensor files must be there (their content is read later)
        (tmp_path / name).write_bytes(b"")
    assert GraphOptConfig.from_options({"plan": str(path)}, environ={}).plan == str(path)


def test_tensorrt_downstream_without_the_extra_names_it():
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("torch_tensorrt") is not None:
        pytest.skip("torch-tensorrt is installed here")
    with pytest.raises(ValueError, match=r"torch-tensorrt.*graphopt\[tensorrt\].*inductor, eager"):
        GraphOptConfig.from_options({"downstream": "tensorrt"}, environ={})


def test_environment_toggles_passes():
    config = GraphOptConfig.from_options(
        {"passes": {"fp4_linear": True}},
        environ={"GRAPHOPT_DISABLE": "attention, fp4_linear", "GRAPHOPT_ENABLE": "q4_linear"},
    )
    assert not config.enabled("attention")
    assert not config.enabled("fp4_linear")
    assert config.enabled("q4_linear")


def test_environment_with_unknown_pass_is_an_error():
    with pytest.raises(ValueError, match="GRAPHOPT_ENABLE"):
        GraphOptConfig.from_options({}, environ={"GRAPHOPT_ENABLE": "flash"})


def test_partial_budget_keeps_other_defaults():
    config = GraphOptConfig.from_options({"error_budget": {"fp4_linear": 20}}, environ={})
    assert config.error_budget["fp4_linear"] == 20.0
    assert config.error_budget["sparse_attention"] == 0.06
