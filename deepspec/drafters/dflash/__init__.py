"""DFlash: the block backbone alone (one parallel forward over [anchor, mask x (g-1)]). `spec.SPEC`."""
