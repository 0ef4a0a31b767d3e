"""Generated protobuf and gRPC code for the ``gpud.v1`` API.

Do not edit: the sources are ``proto/gpud/v1/*.proto``; regenerate with
``python -m tools.protogen`` (``--check`` verifies the committed files).
"""
