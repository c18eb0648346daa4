"""The warning the code-shape check gives (tests/unit/repo/test_code_shape.py), in a module
pytest-xdist's controller can import: a worker's warnings travel to it pickled."""


class ShapeWarning(UserWarning):
    """A module nearing MAX_MODULE_LINES: plan its split along its own seams."""
