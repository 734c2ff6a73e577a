"""_paths"""
