"""SERA over the scenarios of a JAX simulator (the [sim] extra for MuJoCo MJX)."""
