"""qkiln.runtime"""
