"""The target id no loss counts.

A position whose target is IGNORE_INDEX is read by the model but not trained on or scored: a chat
or preference prompt, the question digits of the addition task, the part of an evaluation window
an earlier window already scored, the padding after a short row. Every loss and count passes it
to `F.cross_entropy(ignore_index=...)` or compares against it, so producers and consumers of
targets share this one value (-1, minGPT's, from its addition task; never a real token id).
"""

IGNORE_INDEX = -1
