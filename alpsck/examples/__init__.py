"""Runnable examples built on alpsck (``python -m alpsck.examples.llama``)."""
