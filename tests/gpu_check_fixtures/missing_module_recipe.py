"""A recipe that needs a module this python lacks: gpu-check skips it and names the module."""

import dcp_recipes_module_nobody_installed  # noqa: F401

print("never printed: the import above fails")
