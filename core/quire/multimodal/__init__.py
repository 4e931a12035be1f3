"""Image input for vision-language models: loading images safely (``media.py``), the
model's own processor turning a prompt and its images into token ids and per-image
inputs (``processor.py``), and what an image is to the engine (``inputs.py``)."""
