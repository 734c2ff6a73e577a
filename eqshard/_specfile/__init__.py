"""_specfile"""
