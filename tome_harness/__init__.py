"""The test, benchmark and demo harness: find and boot the real ComfyUI, run it as a server, build
random-weight models of the real layouts and a checkpoint. Not part of the node pack; installed into the
development environment by ``scripts/setup.sh`` (``pip install -e .``), so nothing edits ``sys.path`` to reach it.
"""
