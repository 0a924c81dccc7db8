"""`pytest -p tests.without_megatron`: run the suite as on a machine without megatron-core (a venv
of the runtime dependencies and pytest only). Every import of `megatron` fails as it would there,
so the oracle tests show how they skip (tests/conftest.py) without a second venv."""

import sys


class HideMegatron:
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, HideMegatron())
