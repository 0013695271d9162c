"""The LM-head math shared by the optimizations that never materialize ``[N, V]`` logits: per-token log-probs,
entropies and top-1 flags (``ops.token_stats``, ``ops.logp_entropy``) and the SFT loss (``ops.head_loss``) with their
gradients from hidden states and the head weight and bias (``ops.py``), its Triton passes (``_triton.py``) and the
host-side input checks run before any launch (``_checks.py``). Plain values only: no optimization, option table or
trainer is imported here."""
