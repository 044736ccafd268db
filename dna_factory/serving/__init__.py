"""The HTTP services a stage talks to.

``vllm_server`` a vLLM OpenAI-compatible server as a child process that cannot outlive its owner
``colocate``    stopping the vLLM engine a trainer runs in its own process (``vllm_mode: colocate``)
``services``    waiting for an external service (vLLM, teacher, judge, eval server) with a bounded wait
"""
