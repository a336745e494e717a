// libcurl behind detail/http.h: one handle per request, the global setup done once.
#include "detail/http.h"

#include <curl/curl.h>

#include <memory>
#include <mutex>

namespace accelerate::detail::http {

namespace {

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

size_t append(char* data, size_t size, size_t count, void* out) {
  static_cast<std::string*>(out)->append(data, size * count);
  return size * count;
}

struct EasyDeleter {
  void operator()(CURL* handle) const { curl_easy_cleanup(handle); }
};
struct ListDeleter {
  void operator()(curl_slist* list) const { curl_slist_free_all(list); }
};

}  // namespace

Response perform(const Request& request) {
  global_init();
  Response response;
  std::unique_ptr<CURL, EasyDeleter> handle(curl_easy_init());
  if (!handle) {
    response.error = "could not create a libcurl handle for " + request.url;
    return response;
  }
  CURL* h = handle.get();
  char error[CURL_ERROR_SIZE] = {0};
  curl_slist* list = nullptr;
  for (const auto& header : request.headers) list = curl_slist_append(list, header.c_str());
  std::unique_ptr<curl_slist, ListDeleter> headers(list);
  curl_easy_setopt(h, CURLOPT_URL, request.url.c_str());
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, error);
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);  // no SIGALRM for timeouts: other threads run
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(request.timeout_s * 1000));
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(request.connect_timeout_s * 1000));
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, append);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &response.body);
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers.get());
  if (!request.verify_tls) {
    curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, 0L);
    curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, 0L);
  }
  if (!request.user_password.empty()) {
    curl_easy_setopt(h, CURLOPT_HTTPAUTH, CURLAUTH_BASIC);
    curl_easy_setopt(h, CURLOPT_USERPWD, request.user_password.c_str());
  }
  if (request.method == "GET") {
    curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
  } else {
    curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, request.method.c_str());
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, request.body.data());
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, static_cast<long>(request.body.size()));
  }
  const CURLcode code = curl_easy_perform(h);
  if (code != CURLE_OK) {
    response.error = request.method + " " + request.url + ": " + (error[0] != 0 ? error : curl_easy_strerror(code));
    return response;
  }
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &response.status);
  return response;
}

std::string escape(const std::string& text) {
  global_init();
  std::unique_ptr<CURL, EasyDeleter> handle(curl_easy_init());
  char* escaped = curl_easy_escape(handle.get(), text.data(), static_cast<int>(text.size()));
  std::string out = escaped != nullptr ? escaped : "";
  curl_free(escaped);
  return out;
}

}  // namespace accelerate::detail::http
