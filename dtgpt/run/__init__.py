"""The dtgpt launcher, `python -m dtgpt.run` (`dtgpt-run`): torchrun whose agent replaces failed workers alone.

How: dtgpt/run/agent.py; the environment and the store keys it gives the workers: dtgpt/run/keys.py;
docs/faults.md, "The launcher".
"""
