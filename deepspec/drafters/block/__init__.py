"""Shared by the block drafters (DFlash, DSpark): config base, context fusion, block attention, backbone,
batches, the model, objective terms and proposers."""
