"""Experiment and recipe code of the repository (not installed): what the shell recipes in
examples/ call to prepare data, record runs and write their reports. Run from the repository root
(`python -m experiments.NAME`); the recipes put the root on PYTHONPATH."""
