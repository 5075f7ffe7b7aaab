"""vLLM's OpenAI server with its quantized CPU experts admitted on this CPU (cpu_quantized_experts.py), for test_server.py.

Run as ``python -m tests.eplb_graph.vllm_plugin.lifted_api_server <the server's arguments>``.
"""

from tests.eplb_graph.vllm_plugin.cpu_quantized_experts import lift_if_asked

lift_if_asked()  # at import: the spawned engine core imports this module too

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
