"""What autograd saves and who saves it, shared by both modes: saved-tensor hooks and the scopes
of the modules and ops running (:mod:`.saved_tensors`), the kind of each op (:mod:`.op_kinds`)
and the model's own inputs (:mod:`.model_inputs`).

>>> from actcomp.graph.op_kinds import KINDS
>>> "activation" in KINDS
True
"""
