"""The family table is the only list of architectures, and unsupported ones are refused before any work."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml

from slimtune.cli.main import EXIT_INVALID_SPEC, main
from slimtune.models import families
from slimtune.models.experts import HELD
from slimtune.models.families import FAMILIES, KERNEL_NAMES, check_architecture
from slimtune.models.lora_targets import lora_target_modules
from slimtune.models.tiny import BUILTIN_PREFIX, build_model, save_tiny

PACKAGE = Path(families.__file__).resolve().parent
MOE_CONFIGS = [
    {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 60},
    {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8},
]


def test_every_consumer_takes_its_families_from_the_table():
    import slimtune.export.gguf_convert as gguf_convert
    import slimtune.kernels.apply as kernels
    import slimtune.models.tiny as tiny
    import slimtune.spec.schema as spec
    import slimtune.train.options as options

    names = set(FAMILIES)
    assert set(tiny.FAMILIES) == names
    assert set(gguf_convert.BY_ARCHITECTURE) == {f.architecture for f in FAMILIES.values()}
    assert options.ISOLATING_MODEL_TYPES == names
    assert kernels.KERNEL_NAMES is families.KERNEL_NAMES
    description = spec.ModelSpec.model_fields["name_or_path"].description
    assert all(name in description for name in names)
    for name in names:  # the spec accepts exactly the table's builtin names
        spec.ModelSpec(name_or_path=BUILTIN_PREFIX + name)
    with pytest.raises(ValueError, match="unknown builtin model"):
        spec.ModelSpec(name_or_path=BUILTIN_PREFIX + "mixtral")


def _string_lists(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            yield {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        elif isinstance(node, ast.Dict):
            yield {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def test_no_other_module_lists_families():
    """A tuple, list, set or dict keys naming three or more families anywhere but the table is a copy."""
    names = set(FAMILIES) | {f.architecture for f in FAMILIES.values()}
    copies = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "families.py":
            continue
        for found in _string_lists(ast.parse(path.read_text(encoding="utf-8"))):
            if len(found & names) >= 3:
                copies.append(f"{path.relative_to(PACKAGE)}: {sorted(found & names)}")
    assert not copies, copies


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_row_is_complete_and_its_tiny_model_matches_it(family):
    row = FAMILIES[family]
    assert set(row.kernels) | set(row.eager) == set(KERNEL_NAMES) and not set(row.kernels) & set(row.eager)
    model = build_model(family, 64, num_hidden_layers=row.tiny.get("num_hidden_layers", 2))
    config = model.config.to_dict()
    assert config["model_type"] == family and type(model).__name__ == row.architecture
    assert check_architecture(config) is None
    # every layer's modules by name: hybrid models (Qwen3.5) have linear-attention and attention layers
    layer = {n: m for decoder in model.model.layers for n, m in decoder.named_modules()}
    linears = {n.rsplit(".", 1)[-1] for n, m in layer.items() if type(m).__name__ == "Linear"}
    held = {name for names in HELD.values() for name in names} if row.experts else set()  # every expert's, in 3-D
    assert linears == (set(row.lora_targets) - held) | set(row.frozen_linears)
    if row.experts:
        fused = {f"{projection}_proj" for projection in HELD}
        assert all(
            fused <= {n.rsplit(".", 1)[-1] for n, _ in d.mlp.experts.named_parameters()} for d in model.model.layers
        )
    for fused, parts in row.fused.items():  # a fused projection holds its parts' rows
        assert fused in linears and not set(parts) & linears
    norms = [n for n, m in layer.items() if "Norm" in type(m).__name__ and getattr(m, "weight", None) is not None]
    assert len(norms) == row.layer_norms + (2 if row.qk_norm else 0), norms
    assert bool(config.get("tie_word_embeddings")) == row.tied_default
    if row.layer_output:
        assert row.layer_output in layer


@pytest.mark.parametrize("config", MOE_CONFIGS, ids=lambda c: c["model_type"])
def test_unsupported_architecture_is_one_line_naming_it_and_the_supported(config):
    problem = check_architecture(config)
    assert problem is not None and "\n" not in problem
    assert repr(config["model_type"]) in problem and config["architectures"][0] in problem
    assert ", ".join(FAMILIES) in problem


def test_configs_llama_cpp_cannot_reproduce_are_refused():
    gemma2 = build_model("gemma2", 64, num_hidden_layers=2).config.to_dict()
    assert "query_pre_attn_scalar 256" in check_architecture({**gemma2, "query_pre_attn_scalar": 256})
    phi3 = build_model("phi3", 64, num_hidden_layers=2).config.to_dict()
    factors = {"long_factor": [2.0] * 24, "short_factor": [1.0] * 24}  # 24 = 3/4 of the 64-wide head, halved
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75, **factors}
    assert check_architecture({**phi3, "rope_parameters": longrope}) is None  # llama.cpp's phi3 takes longrope
    short = {**longrope, "short_factor": [1.0] * 32}
    assert "short_factor has 32 values; llama.cpp needs one per rotary frequency (24)" in check_architecture(
        {**phi3, "rope_parameters": short}
    )
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    assert "rope scaling 'yarn' is not converted for phi3" in check_architecture({**phi3, "rope_parameters": yarn})


def test_fused_lora_targets():
    default = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert lora_target_modules("phi3", default) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert lora_target_modules("llama", default) == default
    assert lora_target_modules("phi3", "all-linear") == "all-linear"
    assert lora_target_modules("phi3", ["qkv_proj", "down_proj"]) == ["qkv_proj", "down_proj"]
    with pytest.raises(ValueError, match="phi3 fuses q_proj, k_proj, v_proj into qkv_proj; list all"):
        lora_target_modules("phi3", ["q_proj", "v_proj"])


@pytest.mark.parametrize(
    "command,moe", [("validate", MOE_CONFIGS[0]), ("validate", MOE_CONFIGS[1]), ("run", MOE_CONFIGS[0])]
)
def test_cli_refuses_a_moe_model_before_any_work(tmp_path, capsys, command, moe):
    model_dir = save_tiny(tmp_path / "moe", "qwen2")  # real files; only the config says mixture-of-experts
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, **moe}))
    data = tmp_path / "d.jsonl"  # with a reply: validate refuses data that leaves no token to train on
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data.write_text(json.dumps({"messages": chat}) + "\n")
    spec = tmp_path / "spec.yaml"
    fields = {"name": "moe", "model": {"name_or_path": str(model_dir)}, "data": {"path": str(data)}}
    spec.write_text(yaml.safe_dump(fields))
    capsys.readouterr()  # drop what building the model printed
    assert main([command, str(spec)]) == EXIT_INVALID_SPEC
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and repr(moe["model_type"]) in err[0] and "slimtune supports llama" in err[0], err
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_estimates_count_fused_targets_as_their_parts():
    from slimtune.memory.estimate import estimate_train

    config = build_model("phi3", 64, num_hidden_layers=2).config.to_dict()
    fused = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    default = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    args = dict(micro_batch=1, seq_len=128, lora_r=8, checkpointing="unsloth")
    ours = estimate_train(config, target_modules=fused, **args)
    assert ours == estimate_train(config, target_modules=default, **args)


@pytest.mark.parametrize(
    "targets,problem",
    [
        (None, None),  # the spec's default seven projections: q/k/v and gate/up are fused in Phi-3
        (["qkv_proj", "down_proj"], None),
        (["q_proj", "v_proj"], "phi3 fuses q_proj, k_proj, v_proj into qkv_proj; list all of them (missing k_proj)"),
        (["q_proj", "k_proj", "v_proj", "w9"], "lora.target_modules: ['w9'] not in this model"),
    ],
)
def test_validate_maps_lora_targets_to_fused_projections(tmp_path, targets, problem):
    from slimtune.checks.problems import spec_problems
    from slimtune.spec.schema import parse_spec

    model_dir = save_tiny(tmp_path / "phi3", "phi3")
    data = tmp_path / "d.jsonl"  # with a reply: validate refuses data that leaves no token to train on
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data.write_text(json.dumps({"messages": chat}) + "\n")
    raw = {"name": "p", "output_dir": str(tmp_path / "runs"), "model": {"name_or_path": str(model_dir)}}
    raw |= {"data": {"path": str(data)}, "lora": {} if targets is None else {"target_modules": targets}}
    problems = spec_problems(parse_spec(raw))
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.parametrize("stored", [4, 5])
def test_validate_refuses_more_stored_layers_than_the_model_has(tmp_path, stored):
    from slimtune.checks.problems import spec_problems
    from slimtune.spec.schema import parse_spec

    model_dir = save_tiny(tmp_path / "llama", "llama", num_hidden_layers=4)
    data = tmp_path / "d.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data.write_text(json.dumps({"messages": chat}) + "\n")
    raw = {"name": "p", "output_dir": str(tmp_path / "runs"), "model": {"name_or_path": str(model_dir)}}
    raw |= {"data": {"path": str(data)}, "train": {"stored_layers": stored}}
    problems = spec_problems(parse_spec(raw))
    if stored == 4:
        assert problems == []
    else:
        assert problems == [
            f"train.stored_layers is 5 but {model_dir / 'config.json'} has 4 decoder layers; use at most 4 (or auto)"
        ]
