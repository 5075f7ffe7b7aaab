"""The Triton (CUDA) routing kernel compiled for real GPU targets, with no GPU present.

Not collected by ``make test`` directly: ``test_triton_routing.py`` runs this file in a
subprocess with the lent GPU image's Triton release on its path and *without*
``TRITON_INTERPRET``, so Triton's full pipeline runs (AST -> TTIR -> TTGIR -> LLVM IR -> PTX ->
cubin through the ``ptxas`` its wheel ships). The interpreter runs a kernel as Python and
accepts what the compiler refuses (a plain-int global read inside ``@triton.jit`` compiled
there and failed here).

What this proves: every argument signature our launches produce (ids and load dtypes,
upstream's bool record flag and int32/int64 token counts, RECORD on and off, Triton's
specialisation of integer arguments equal to 1) compiles to a cubin for sm_90 (the lent
H200) and sm_80. What it does not prove: that the cubin loads and runs on a device, its
results (the interpreter cases check the logic), or CUDA-graph capture.
"""

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from eplb_graph.custom_ops import triton_routing  # noqa: E402

POINTER_TYPES = {torch.bool: "*i1", torch.int32: "*i32", torch.int64: "*i64"}
TARGETS = [GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32)]
# the integer arguments after the pointers, in the kernel's order
INT_ARGS = ("numel", "top_k", "num_logical", "max_replicas", "num_physical")


def signature(ids_dtype, load_dtype, record_dtype, tokens_dtype, ones: tuple[str, ...]) -> dict[str, str]:
    """The kernel's signature as ``_launch`` produces it: physical ids take the ids' dtype;
    an integer argument equal to 1 is specialised by Triton's launcher into a constexpr."""
    sig = {
        "topk_ids_ptr": POINTER_TYPES[ids_dtype],
        "lookup_ptr": "*i32",
        "replica_count_ptr": "*i32",
        "physical_ids_ptr": POINTER_TYPES[ids_dtype],
        "load_ptr": POINTER_TYPES[load_dtype],
        "record_enabled_ptr": POINTER_TYPES[record_dtype],
        "num_unpadded_tokens_ptr": POINTER_TYPES[tokens_dtype],
    }
    sig.update({name: "constexpr" if name in ones else "i32" for name in INT_ARGS})
    sig.update(RECORD="constexpr", BLOCK_SIZE="constexpr")
    return sig


CASES = list(itertools.product(
    [torch.int32, torch.int64],  # ids
    [torch.int32, torch.int64],  # load: upstream's expert_load_pass is int32, LayerLookup's int64
    [torch.bool, torch.int32],  # record flag: upstream's should_record_tensor is bool
    [torch.int32, torch.int64],  # unpadded tokens: upstream int32, BatchFlags int64
    [True, False],  # RECORD
))


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm_{t.arch}")
@pytest.mark.parametrize("ids_dtype,load_dtype,record_dtype,tokens_dtype,record", CASES)
def test_the_kernel_compiles_to_cubin(target, ids_dtype, load_dtype, record_dtype, tokens_dtype, record):
    sig = signature(ids_dtype, load_dtype, record_dtype, tokens_dtype, ones=())
    compiled = triton.compile(
        ASTSource(fn=triton_routing._map_and_record_kernel, signature=sig,
                  constexprs={"RECORD": record, "BLOCK_SIZE": 256}),
        target=target,
    )
    assert len(compiled.asm["cubin"]) > 0
    assert f".target sm_{target.arch}" in compiled.asm["ptx"]


@pytest.mark.parametrize("ones", [("top_k",), ("max_replicas", "num_logical"), ("numel", "top_k", "num_physical")])
def test_integer_arguments_specialised_to_one_still_compile(ones):
    """top_k 1, a single logical expert without replicas, one token: Triton passes these as constexpr 1."""
    sig = signature(torch.int64, torch.int32, torch.bool, torch.int32, ones)
    constexprs = {"RECORD": True, "BLOCK_SIZE": 256, **{name: 1 for name in ones}}
    compiled = triton.compile(ASTSource(fn=triton_routing._map_and_record_kernel, signature=sig, constexprs=constexprs),
                              target=TARGETS[0])
    assert len(compiled.asm["cubin"]) > 0
