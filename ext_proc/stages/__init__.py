"""The request stages: one module per step of a request's life in ext_proc (``ext_proc/stage.py`` says what a
stage is; ``ext_proc/pipeline.py`` declares their order). A stage imports no other stage."""
