"""Vision encoders of image-text models, on the op set: CLIP's tower (LLaVA)."""
