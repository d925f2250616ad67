"""Decoding: the round (round.py), its budget policies (budget.py), static buffers and the packet
(buffers.py), graph capture (graphs.py), the host-tree reference loop (reference.py), token choice
(sampling.py), and the Decoder that runs a generation (decoder.py)."""
