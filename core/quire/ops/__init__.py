"""The ops model code composes, and the set a platform provides.

Model code (``quire.models``) calls ``ctx.ops.<op>(...)`` for every op whose fastest form
depends on the hardware; it never knows which platform runs. A platform returns its
:class:`OpSet` from ``Platform.make_ops()``: the reference set (:mod:`quire.ops.reference`,
plain torch, every platform's oracle) with the entries it implements natively replaced.
Each op's contract (shapes, dtypes, what it may not change) is the reference function's
docstring; a platform's version must agree with it up to float rounding.
"""

from quire.ops.opset import OpSet, reference_ops

__all__ = ["OpSet", "reference_ops"]
