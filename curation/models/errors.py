"""What the model store raises: a reference found nowhere, or a file that is not the one its pin names."""


class ModelNotFoundError(RuntimeError):
    """A model reference resolves nowhere; the message says where it looked and how to provide the weights."""


class ModelIntegrityError(RuntimeError):
    """A model file is not the one its sha256 pin names, or a hub download has no pinned revision."""
