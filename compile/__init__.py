"""qkiln.compile"""
