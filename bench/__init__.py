"""qkiln.bench"""
