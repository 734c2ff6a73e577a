"""_process"""
