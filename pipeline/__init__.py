"""Thin DVC stage entry points: `python -m pipeline.<stage> <model-key>`.

Each stage reads its params from params.yaml, calls the veloxquant library and writes its
outputs under artifacts/<model-key>/.
"""
