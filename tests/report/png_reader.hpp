#pragma once
// Decode a PNG into RGB pixels with libpng, so the figure tests can check what a reader
// sees: the image's size and which colours it holds.
#include <png.h>

#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace lar::report::testing {

struct RgbImage {
  int width = 0, height = 0;
  std::vector<unsigned char> rgb;  // row-major, 3 bytes a pixel
  unsigned at(int x, int y) const {
    const size_t i = (static_cast<size_t>(y) * width + x) * 3;
    return (unsigned(rgb[i]) << 16) | (unsigned(rgb[i + 1]) << 8) | rgb[i + 2];
  }
};

inline RgbImage read_png(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open " + path);
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    std::fclose(f);
    throw std::runtime_error("libpng could not decode " + path);
  }
  png_init_io(png, f);
  png_read_info(png, info);
  // Whatever gnuplot wrote (palette, 16-bit, alpha): 8-bit RGB.
  png_set_expand(png);
  png_set_strip_16(png);
  png_set_strip_alpha(png);
  png_set_gray_to_rgb(png);
  png_read_update_info(png, info);
  RgbImage img;
  img.width = static_cast<int>(png_get_image_width(png, info));
  img.height = static_cast<int>(png_get_image_height(png, info));
  img.rgb.resize(static_cast<size_t>(img.width) * img.height * 3);
  std::vector<png_bytep> rows(img.height);
  for (int y = 0; y < img.height; ++y) rows[y] = img.rgb.data() + static_cast<size_t>(y) * img.width * 3;
  png_read_image(png, rows.data());
  png_destroy_read_struct(&png, &info, nullptr);
  std::fclose(f);
  return img;
}

// Pixels of each exact colour.
inline std::map<unsigned, size_t> colour_histogram(const RgbImage& img) {
  std::map<unsigned, size_t> h;
  for (int y = 0; y < img.height; ++y)
    for (int x = 0; x < img.width; ++x) ++h[img.at(x, y)];
  return h;
}

// Pixels within `tol` (per channel) of `colour` ("#rrggbb").
inline size_t pixels_near(const std::map<unsigned, size_t>& h, const std::string& colour, int tol = 8) {
  const unsigned c = static_cast<unsigned>(std::stoul(colour.substr(1), nullptr, 16));
  size_t n = 0;
  for (const auto& [k, v] : h) {
    auto ch = [](unsigned x, int s) { return static_cast<int>((x >> s) & 0xff); };
    if (std::abs(ch(k, 16) - ch(c, 16)) <= tol && std::abs(ch(k, 8) - ch(c, 8)) <= tol && std::abs(ch(k, 0) - ch(c, 0)) <= tol) n += v;
  }
  return n;
}

}  // namespace lar::report::testing
