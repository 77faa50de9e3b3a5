"""qkiln.plugins"""
