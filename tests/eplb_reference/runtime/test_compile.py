"""The step's callable for a mode: compiled with the EPLB pass, with Inductor's C++ wrapper."""

import torch

from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.step import check_output


def test_cpp_wrapper_compiles_a_forward_that_calls_the_routing_op_from_cpp():
    from torch._inductor.utils import run_and_get_code

    from eplb_reference.bench.harness import decode_batches
    from eplb_reference.runtime.compile import prepare_forward
    from eplb_reference.runtime.stack import build_rank_models

    cfg = RunConfig(ranks=1, cpp_wrapper=True)
    cfg.validate()
    with torch.no_grad():
        model, reference, rank_layers, flags = build_rank_models(cfg, 0, 1, None)
        forward = prepare_forward(model, cfg, rank_layers, [])
        batch = decode_batches(cfg, 0, torch.device("cpu"))[0]
        flags.set_(record=True, num_unpadded_tokens=batch.num_tokens)
        out, codes = run_and_get_code(forward, batch.tokens)
        expected = reference(batch.tokens)
    code = "\n".join(codes)
    # the forward is C++: the routing op is reached through the dispatcher, not torch.ops in Python
    assert '"eplb_graph::map_and_record_layer"' in code
    assert "torch.ops.eplb_graph.map_and_record_layer.default(" not in code
    assert check_output(out, expected, cfg.output_tolerance).ok
    assert [int(layer.tables.load.sum()) for layer in rank_layers] == [batch.num_tokens * cfg.top_k] * cfg.num_layers
