"""On a GPU, a mixture of experts trains through the flow with its experts in NF4 on the device.

The CPU tests (test_family_qwen3_moe.py, test_family_gpt_oss.py, test_nf4_experts.py) hold the arithmetic; this
runs the same tasks where users run them: load_4bit quantizing each layer's experts on CUDA, LoRA on attention and
on every expert, packed training under the guard, merge and the f16 GGUF. Run through the device tool:
`pytest -m gpu tests/test_gpu_moe.py`.
"""

import copy
import json

import pytest
import torch

from tests.tiny_flows import tiny_flow_spec

pytestmark = pytest.mark.gpu


# the checkpoint dtypes load_4bit quantizes on CUDA (it casts to the 16-bit compute dtype first); from float32 input
# bitsandbytes' CUDA quantizer rounds some elements to the other code than the torch formula (measured on an H200)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_dequantize_is_bitsandbytes_kernel_and_equals_the_torch_formula(dtype):
    """On CUDA an expert is dequantized by bitsandbytes' kernel: it must give exactly what the torch formula (the
    CPU path, held to bitsandbytes in test_nf4_experts.py) gives from the same bytes, and what bitsandbytes gives
    for that expert's matrix quantized alone (whose bytes the CUDA quantization equals), at Qwen3-30B-A3B's and
    gpt-oss-20b's expert shapes."""
    import bitsandbytes.functional as bnbf

    from slimtune.kernels.nf4_experts import quantize_experts

    torch.manual_seed(0)
    for shape in [(4, 768, 2048), (2, 2880, 5760)]:
        weight = (torch.randn(shape, device="cuda") * 0.02).to(dtype)
        storage = quantize_experts(weight, torch.bfloat16)
        on_cpu = copy.deepcopy(storage).cpu()  # the same bytes, dequantized by the torch formula
        for e in range(shape[0]):
            packed, state = bnbf.quantize_4bit(weight[e], quant_type="nf4", compress_statistics=True, blocksize=64)
            assert torch.equal(storage.packed[e], packed.view(-1)), (shape, e)  # quantized on CUDA as bnb does
            state.dtype = torch.bfloat16
            ours = storage.dequantize_experts(e, e + 1)[0]
            assert ours.is_cuda and ours.dtype == torch.bfloat16
            assert torch.equal(ours, bnbf.dequantize_4bit(packed, state)), (shape, e)
            assert torch.equal(ours.cpu(), on_cpu.dequantize_experts(e, e + 1)[0]), (shape, e)
            assert torch.equal(
                storage.dequantize_experts(e, e + 1, torch.float32)[0].cpu(),
                on_cpu.dequantize_experts(e, e + 1, torch.float32)[0],
            )


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_grouped_gemms_on_cuda_match_the_expert_loop(family):
    """On CUDA the projections run as torch's grouped GEMMs (bf16, widths of whole 16-byte rows): output, input
    gradient and LoRA gradients match a per-expert loop of plain matmuls on the same dequantized weights (and LoRA
    cast to bf16) in transformers' order, within bf16 rounding (the two GEMM kernels may sum in other orders); and
    two runs give the same bits (each token's contributions are added in expert order, with no atomics)."""
    from slimtune.kernels.nf4_experts import NF4Experts
    from tests.test_nf4_experts import _E, _experts, _routing, _tiny_model

    nf4 = NF4Experts.from_experts(_experts(_tiny_model(family, torch.bfloat16)), torch.bfloat16).cuda()
    nf4.add_lora(rank=8, scale=2.0, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    for name in ("gate_up", "down"):
        b = getattr(nf4, f"{name}_lora_B")
        b.data = (torch.randn(b.shape, generator=g) * 0.05).cuda()
    dense = {n: getattr(nf4, n).dequantize_experts(0, _E) for n in ("gate_up", "down")}
    lora = {n: [getattr(nf4, f"{n}_lora_{ab}").detach().clone().requires_grad_() for ab in "AB"] for n in dense}

    def project(h: torch.Tensor, name: str, e: int) -> torch.Tensor:
        w, (a, b), bias = dense[name][e], lora[name], getattr(nf4, f"{name}_bias")
        y = h @ w if nf4.transposed else h @ w.t()
        y = y if bias is None else y + bias[e]
        return y + (h @ a[e].to(h.dtype).t()) @ b[e].to(h.dtype).t() * nf4.lora_scale

    x, index, weights = (t.cuda() for t in _routing(64, torch.bfloat16))
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = torch.zeros_like(x)
    for e in range(_E):
        position, token = torch.where(index.t() == e)
        hidden = project(nf4.gate_fn(project(x_ref[token], "gate_up", e)), "down", e)
        expected = expected.index_add(0, token, hidden * weights[token, position, None])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = nf4(x_ours, index, weights)
    assert any(event.key == "aten::_grouped_mm" for event in prof.key_averages())  # not the per-expert fallback
    assert torch.equal(nf4(x, index, weights), got)
    grad = torch.randn(got.shape, generator=g).to(torch.bfloat16).cuda()
    got.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(got, expected)  # bf16 tolerances: rtol 1.6e-2
    torch.testing.assert_close(x_ours.grad, x_ref.grad)
    for name, (a, b) in lora.items():
        torch.testing.assert_close(getattr(nf4, f"{name}_lora_A").grad, a.grad, rtol=1.6e-2, atol=1e-4)
        torch.testing.assert_close(getattr(nf4, f"{name}_lora_B").grad, b.grad, rtol=1.6e-2, atol=1e-4)
        assert b.grad.abs().max() > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_flow_trains_nf4_experts_on_cuda(family, prefect_harness, tmp_path):
    from safetensors.torch import load_file

    from slimtune.flows.finetune import finetune

    spec = tiny_flow_spec(family, tmp_path)
    spec.model.device = "cuda"
    spec.export.gguf = ["f16"] if _llama_cpp() else []
    assert finetune(spec, return_state=True).is_completed()
    report = json.loads((spec.run_dir() / "report.json").read_text())
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(report["attach_lora"]["target_modules"])
    train = report["packed_sft"]
    assert train["eval_loss_after"] < train["eval_loss_before"], train
    adapter = load_file(spec.run_dir() / "adapter" / "adapter_model.safetensors")
    assert any(".mlp.experts." in k and v.abs().sum() > 0 for k, v in adapter.items() if k.endswith("lora_B.weight"))
    [sft] = [m for m in report["memory"] if m["stage"] == "packed_sft"]
    assert sft["peak_gpu_allocated"] > 0 and sft["peak_device_used"] > 0  # it ran on the card


def _llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None
