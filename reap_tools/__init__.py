"""Offline tools for the Kimi K3 REAP checkpoint: observe, plan, prune, verify, train a BPE, …

Run them as `python -m reap_tools VERB ...`; `python -m reap_tools --help` lists the verbs.
"""
