#!/usr/bin/python3
"""svg_to_png.py IN.svg OUT.png [SCALE]: renders an SVG with the system's librsvg and cairo
(through ctypes, for machines that have the libraries but no rsvg-convert)."""
import ctypes
import ctypes.util
import sys


def lib(name, soname):
    path = ctypes.util.find_library(name) or soname
    return ctypes.CDLL(path)


def main():
    src, dst = sys.argv[1], sys.argv[2]
    scale = float(sys.argv[3]) if len(sys.argv) > 3 else 2.0
    rsvg = lib("rsvg-2", "librsvg-2.so.2")
    cairo = lib("cairo", "libcairo.so.2")
    rsvg.rsvg_handle_new_from_file.restype = ctypes.c_void_p
    rsvg.rsvg_handle_new_from_file.argtypes = [ctypes.c_char_p, ctypes.c_void_p]

    class Dim(ctypes.Structure):
        _fields_ = [("width", ctypes.c_int), ("height", ctypes.c_int),
                    ("em", ctypes.c_double), ("ex", ctypes.c_double)]

    handle = rsvg.rsvg_handle_new_from_file(src.encode(), None)
    if not handle:
        sys.exit("svg_to_png: librsvg could not read " + src)
    dim = Dim()
    rsvg.rsvg_handle_get_dimensions.argtypes = [ctypes.c_void_p, ctypes.POINTER(Dim)]
    rsvg.rsvg_handle_get_dimensions(handle, ctypes.byref(dim))
    cairo.cairo_image_surface_create.restype = ctypes.c_void_p
    surface = cairo.cairo_image_surface_create(0, int(dim.width * scale), int(dim.height * scale))
    cairo.cairo_create.restype = ctypes.c_void_p
    cairo.cairo_create.argtypes = [ctypes.c_void_p]
    cr = cairo.cairo_create(surface)
    cairo.cairo_scale.argtypes = [ctypes.c_void_p, ctypes.c_double, ctypes.c_double]
    cairo.cairo_scale(cr, scale, scale)
    rsvg.rsvg_handle_render_cairo.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    if not rsvg.rsvg_handle_render_cairo(handle, cr):
        sys.exit("svg_to_png: librsvg could not render " + src)
    cairo.cairo_surface_write_to_png.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    if cairo.cairo_surface_write_to_png(surface, dst.encode()) != 0:
        sys.exit("svg_to_png: could not write " + dst)


if __name__ == "__main__":
    main()
